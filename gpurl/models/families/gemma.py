"""Gemma (HF `GemmaForCausalLM`, llama.cpp `gemma`): GeGLU, (1 + w) RMSNorm, sqrt(D)-scaled
embeddings, tied output head. Also the conventions Gemma 2 and 3 build on."""

from __future__ import annotations

from typing import Any

from gpurl.models.families.base import Family, GGUFArch, GGUFMetadata, HFFamily, hf_defaults

# What Gemma 2 and 3 share in config.json: sandwich norms, layer types, their defaults.
GEMMA_HF = dict(gemma=True, act_key="hidden_activation", layer_types=True, post_norms=True)
GEMMA_HF_DEFAULTS = dict(hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                         query_pre_attn_scalar=256, sliding_window=4096)


def gemma_gguf_fields(meta: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    return dict(fields, family="gemma", activation="gelu_tanh", norm_plus_one=True,
                scale_embeddings=True, query_pre_attn_scalar=float(fields["head_dim"]))


def gemma_query_scalar(fields: dict[str, Any], big_layers: int) -> float:
    # llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA2/GEMMA3): the 27B models scale queries
    # by d_model / heads, every other size by head_dim; the file does not say which.
    if fields["num_layers"] == big_layers:
        return fields["d_model"] / fields["num_heads"]
    return float(fields["head_dim"])


FAMILY = Family(
    name="gemma",
    hf=HFFamily(("gemma",), "GemmaForCausalLM", "hidden_act", gemma=True, post_norms=False,
                qk_norm=False, qkv_bias=None, layer_types=False, local_rope=False,
                defaults=hf_defaults(256000, 3072, 24576, 28, 16, 16, 256,
                                     hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True),
                # transformers' reading of the original Gemma releases
                activation_aliases={"gelu": "gelu_pytorch_tanh"}),
    gguf=GGUFArch("gemma", gemma_gguf_fields, norm_offset=1.0, permuted_qk=False, tokenizer=True))

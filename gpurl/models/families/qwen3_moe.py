"""Qwen3-MoE (HF `Qwen3MoeForCausalLM`): the Qwen 3 decoder (QK-norm, no biases) whose
MLPs are mixtures of SwiGLU experts (`gpurl.models.moe`), top-k of `num_experts` per
token; `mlp_only_layers` and `decoder_sparse_step` keep some layers dense."""

from __future__ import annotations

from gpurl.models.families.base import Family, HFFamily, hf_defaults

FAMILY = Family(
    name="qwen3_moe",
    hf=HFFamily(("qwen3_moe",), "Qwen3MoeForCausalLM", "hidden_act", gemma=False, post_norms=False,
                qk_norm=True, qkv_bias=None, layer_types=False, local_rope=False,
                defaults=hf_defaults(151936, 2048, 6144, 24, 32, 4, None, hidden_act="silu",
                                     tie_word_embeddings=False, num_experts=128,
                                     num_experts_per_tok=8, moe_intermediate_size=768,
                                     norm_topk_prob=False, decoder_sparse_step=1),
                export_keys={"use_sliding_window": False}, moe=True))

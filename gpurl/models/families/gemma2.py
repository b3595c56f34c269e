"""Gemma 2 (HF `Gemma2ForCausalLM`): Gemma plus sandwich norms, alternating sliding-window
and global layers sharing one RoPE base, and soft-capped attention and output logits."""

from __future__ import annotations

from typing import Any

from gpurl.models.families.base import Family, GGUFArch, GGUFMetadata, HFFamily, hf_defaults
from gpurl.models.families.gemma import (GEMMA_HF, GEMMA_HF_DEFAULTS, gemma_gguf_fields,
                                         gemma_query_scalar)


def _gguf_fields(meta: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    # Defaults from llama.cpp (llama-hparams.h, llama-model.cpp) for files that omit them.
    return dict(gemma_gguf_fields(meta, fields), family="gemma2", post_norms=True,
                global_every=2, sliding_window=meta.get("attention.sliding_window", 4096),
                attn_softcap=meta.get("attn_logit_softcapping", 50.0, float),
                final_softcap=meta.get("final_logit_softcapping", 30.0, float),
                query_pre_attn_scalar=gemma_query_scalar(fields, big_layers=46))


FAMILY = Family(
    name="gemma2",
    hf=HFFamily(("gemma2",), "Gemma2ForCausalLM", **GEMMA_HF, qk_norm=False, qkv_bias=None,
                local_rope=False, defaults=hf_defaults(
                    256000, 2304, 9216, 26, 8, 4, 256, **GEMMA_HF_DEFAULTS,
                    sliding_window_pattern=2, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0)),
    gguf=GGUFArch("gemma2", _gguf_fields, norm_offset=1.0, permuted_qk=False, tokenizer=True))

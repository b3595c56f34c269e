"""Gemma 3 (HF `Gemma3ForCausalLM`, model_type gemma3_text; the multimodal `gemma3`
checkpoints' text model): Gemma 2's layout with QK-norm, five sliding-window layers per
global one, and a RoPE base of their own for the sliding layers."""

from __future__ import annotations

from typing import Any

from gpurl.models.families.base import Family, GGUFArch, GGUFMetadata, HFFamily, hf_defaults
from gpurl.models.families.gemma import (GEMMA_HF, GEMMA_HF_DEFAULTS, gemma_gguf_fields,
                                         gemma_query_scalar)


def _gguf_fields(meta: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
    out = dict(gemma_gguf_fields(meta, fields), family="gemma3", post_norms=True,
               final_softcap=meta.get("final_logit_softcapping", 0.0, float) or None,
               query_pre_attn_scalar=gemma_query_scalar(fields, big_layers=62))
    window = meta.get("attention.sliding_window", 0)
    if window:
        # llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA3) hard-codes the 5 local : 1
        # global pattern and the local RoPE base 10000 (`rope_freq_base_train_swa`).
        out.update(sliding_window=window, global_every=6,
                   rope_local_theta=meta.get("rope.freq_base_swa", 10000.0, float))
    return out


FAMILY = Family(
    name="gemma3",
    hf=HFFamily(("gemma3_text", "gemma3"), "Gemma3ForCausalLM", **GEMMA_HF, qk_norm=True,
                qkv_bias=None, local_rope=True, defaults=hf_defaults(
                    262208, 2304, 9216, 26, 8, 4, 256, **GEMMA_HF_DEFAULTS,
                    sliding_window_pattern=6, rope_theta=1_000_000.0,
                    rope_local_base_freq=10_000.0),
                # transformers names the text-only classifier after Gemma3TextModel
                classifier="Gemma3TextForSequenceClassification"),
    gguf=GGUFArch("gemma3", _gguf_fields, norm_offset=1.0, permuted_qk=False, tokenizer=True))

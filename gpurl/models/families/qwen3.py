"""Qwen 3 (HF `Qwen3ForCausalLM`): the Llama layout with RMSNorm over each query and key head."""

from __future__ import annotations

from gpurl.models.families.base import Family, GGUFArch, HFFamily, hf_defaults, llama_like_gguf

FAMILY = Family(
    name="qwen3",
    hf=HFFamily(("qwen3",), "Qwen3ForCausalLM", "hidden_act", gemma=False, post_norms=False,
                qk_norm=True, qkv_bias=None, layer_types=False, local_rope=False,
                defaults=hf_defaults(151936, 4096, 22016, 32, 32, 32, 128, hidden_act="silu"),
                export_keys={"use_sliding_window": False}),
    gguf=GGUFArch("qwen3", llama_like_gguf("qwen3"), norm_offset=0.0, permuted_qk=False))

"""Qwen 2.5 (HF `Qwen2ForCausalLM`): the Llama layout with biases on q, k and v."""

from __future__ import annotations

from gpurl.models.families.base import Family, GGUFArch, HFFamily, hf_defaults, llama_like_gguf

FAMILY = Family(
    name="qwen2",
    hf=HFFamily(("qwen2",), "Qwen2ForCausalLM", "hidden_act", gemma=False, post_norms=False,
                qk_norm=False, qkv_bias=True, layer_types=False, local_rope=False,
                defaults=hf_defaults(151936, 4096, 22016, 32, 32, 32, hidden_act="silu"),
                export_keys={"use_sliding_window": False}),
    gguf=GGUFArch("qwen2", llama_like_gguf("qwen2"), norm_offset=0.0, permuted_qk=False))

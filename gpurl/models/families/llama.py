"""Llama 2 / 3.x (HF `LlamaForCausalLM`): SwiGLU, plain RMSNorm, optional Llama 3.1 RoPE
scaling; llama.cpp interleaves the q/k rows of its files for its RoPE."""

from __future__ import annotations

from gpurl.models.families.base import Family, GGUFArch, HFFamily, hf_defaults, llama_like_gguf

FAMILY = Family(
    name="llama",
    hf=HFFamily(("llama",), "LlamaForCausalLM", "hidden_act", gemma=False, post_norms=False,
                qk_norm=False, qkv_bias=None, layer_types=False, local_rope=False,
                defaults=hf_defaults(32000, 4096, 11008, 32, 32, hidden_act="silu")),
    gguf=GGUFArch("llama", llama_like_gguf("llama"), norm_offset=0.0, permuted_qk=True))

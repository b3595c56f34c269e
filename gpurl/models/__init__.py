"""Models: one decoder (`transformer`), families by config (`families/`), the specs jitted
code runs them through (`spec`, `scalar`), and their checkpoints: HF safetensors (`hf`,
`hf_export`), GGUF (`gguf`), tokenizers, LoRA adapters.

The public face below; modules inside the package import each other directly.
"""

from __future__ import annotations

from gpurl.models.spec import ModelSpec, Params, count_params, model_spec
from gpurl.models.transformer import KVCache, Transformer, compute_dtype, init_cache

__all__ = ["KVCache", "ModelSpec", "Params", "Transformer", "compute_dtype", "count_params",
           "init_cache", "model_spec"]

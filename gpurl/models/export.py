"""Exporters of a trained tree to a Hugging Face directory, one per kind of tree (the
`export` of an algorithm's record in `gpurl.algorithms.registry`).

A LoRA run's adapters are merged into the base, or written alone in PEFT's layout
(`adapter=True`); every process must call an exporter (sharded arrays are gathered).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpurl.config import ConfigError, ModelConfig
from gpurl.models import lora
from gpurl.models.hf_export import export_hf, export_peft
from gpurl.models.scalar import export_scalar_hf
from gpurl.models.spec import Params


def _check_adapter(cfg: ModelConfig, adapter: bool) -> None:
    if adapter and not cfg.lora.rank:
        raise ConfigError("adapter=true exports LoRA adapters, but the run trained with "
                          "model.lora.rank=0; export it without adapter=true.")


def export_language_model(spec: Any, params: Params, cfg: ModelConfig, out_dir: str | Path,
                          adapter: bool = False) -> Path:
    """The language model inside `params` (PPO's policy, not its critic) as a causal LM."""
    _check_adapter(cfg, adapter)
    lm = spec.policy_params(params)
    if adapter:
        return export_peft(lm, cfg, out_dir, cfg.checkpoint or cfg.hub_id)
    if cfg.lora.rank:
        lm, cfg = lora.merged(lm, cfg), lora.base_config(cfg)
    return export_hf(lm, cfg, out_dir)


def export_reward_model(spec: Any, params: Params, cfg: ModelConfig, out_dir: str | Path,
                        adapter: bool = False) -> Path:
    """A scalar model as an HF ...ForSequenceClassification directory."""
    _check_adapter(cfg, adapter)
    if adapter:
        raise ConfigError("adapter=true writes a causal-LM adapter, but this run trained a "
                          "reward model (algo=rm); export it without adapter=true.")
    if cfg.lora.rank:
        params = {**params, "backbone": lora.merged(params["backbone"], cfg)}
        cfg = lora.base_config(cfg)
    return export_scalar_hf(params, cfg, out_dir)

"""`gpurl export`: a run directory's newest (or a chosen) checkpoint -> an HF directory.

The run's config.yaml gives the architecture, the Orbax checkpoint the parameters
(restored sharded over the local devices), the algorithm's record the exporter (a causal
LM, or a reward model's sequence classifier), and the tokenizer is the one the run used.
"""

from __future__ import annotations

from pathlib import Path

from gpurl.algorithms import registry
from gpurl.models.loading import load_tokenizer
from gpurl.models.tokenizer import save_tokenizer
from gpurl.train.restore import restore_run


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               adapter: bool = False) -> Path:
    """Writes config.json, model.safetensors and the tokenizer of `run_dir` into `out_dir`:
    the language model (PPO: the policy, not the critic), or for an algo=rm run the reward
    model as an HF ...ForSequenceClassification directory. A LoRA run's adapters are merged
    into the base, or with `adapter` written alone in PEFT's layout."""
    cfg, params = restore_run(run_dir, step, language_model=False)
    algorithm = registry.get(cfg.algo.name)
    spec = algorithm.model(cfg.algo, cfg.model)
    out = Path(algorithm.export(spec, params, cfg.model, out_dir, adapter))
    save_tokenizer(load_tokenizer(cfg.model), out)
    return out

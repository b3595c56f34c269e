"""`gpurl export`: a run directory's newest (or a chosen) checkpoint -> an HF directory.

The run's config.yaml gives the architecture, the Orbax checkpoint the parameters
(restored sharded over the local devices), and the tokenizer is the one the run used.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from gpurl.config import Config, ConfigError, MeshConfig, from_dict
from gpurl.distributed.mesh import trainer_mesh
from gpurl.models import Params, model_spec
from gpurl.models.tokenizer import load_tokenizer, save_tokenizer
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.optim import make_optimizer
from gpurl.train.step import placement


def restore_run(run_dir: str | Path, step: int | None = None) -> tuple[Config, Params]:
    """A run's config and the parameters of its newest (or given) checkpoint, sharded over
    every local device (never whole on one device)."""
    run = Path(run_dir)
    config_file = run / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(f"{run} holds no config.yaml; point checkpoint= at a gpurl run directory.")
    try:  # safe_load: a Python tag in the file is an error, never a call
        cfg = from_dict(yaml.safe_load(config_file.read_text()))
    except (yaml.YAMLError, TypeError, AttributeError) as e:
        raise ConfigError(f"{config_file} is not a gpurl config ({str(e).splitlines()[0]}); "
                          f"point checkpoint= at a gpurl run directory.") from None
    ckpt = Checkpointer(run / "checkpoints", keep=cfg.train.keep_checkpoints)
    step = ckpt.latest_step() if step is None else step
    if step is None or step not in ckpt.all_steps():
        raise ConfigError(
            f"{run}/checkpoints has no checkpoint {'yet' if step is None else f'at step {step}'}; "
            f"available steps: {ckpt.all_steps() or 'none'}.")
    mesh = trainer_mesh(MeshConfig(data=1, fsdp=-1))
    spec = model_spec(cfg.model)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    place = placement(spec, optimizer, mesh, cfg.mesh.train_rules)
    state, _ = ckpt.restore(step, place.abstract_state, place.state)
    ckpt.close()
    return cfg, state.params


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    """Writes config.json, model.safetensors and the tokenizer of `run_dir` into `out_dir`."""
    from gpurl.models.hf_export import export_hf

    cfg, params = restore_run(run_dir, step)
    out = export_hf(params, cfg.model, out_dir)
    save_tokenizer(load_tokenizer(cfg.model), out)
    return Path(out)

"""A finished or running gpurl run read back: its config and a checkpoint's parameters
(for `gpurl export`, `gpurl eval` and `gpurl generate` with checkpoint=RUN_DIR)."""

from __future__ import annotations

from pathlib import Path

import yaml

from gpurl.algorithms import registry
from gpurl.config import Config, ConfigError, MeshConfig
from gpurl.distributed.mesh import trainer_mesh
from gpurl.models.spec import Params
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.optim import train_optimizer
from gpurl.train.step import checkpointed, complete, make_init, placement, scaling_for
from gpurl.train.weights import load_initial


def read_run_config(run_dir: str | Path) -> Config:
    """The config a run recorded in its config.yaml."""
    config_file = Path(run_dir) / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(f"{run_dir} holds no config.yaml; point checkpoint= at a gpurl run "
                          f"directory.")
    try:  # safe_load: a Python tag in the file is an error, never a call
        return registry.parse(yaml.safe_load(config_file.read_text()))
    except (yaml.YAMLError, TypeError, AttributeError) as e:
        raise ConfigError(f"{config_file} is not a gpurl config ({str(e).splitlines()[0]}); "
                          f"point checkpoint= at a gpurl run directory.") from None


def restore_run(run_dir: str | Path, step: int | None = None,
                language_model: bool = True) -> tuple[Config, Params]:
    """A run's config and the parameters of its newest (or given) checkpoint, sharded over
    every local device (never whole on one device). With `language_model`, the language
    model inside them (PPO's policy); otherwise the whole trained tree."""
    run = Path(run_dir)
    cfg = read_run_config(run)
    ckpt = Checkpointer(run / "checkpoints", keep=cfg.train.keep_checkpoints)
    step, steps = (ckpt.latest_step() if step is None else step), ckpt.all_steps()
    if step is None or step not in steps:
        ckpt.close()
        raise ConfigError(
            f"{run}/checkpoints has no checkpoint {'yet' if step is None else f'at step {step}'}; "
            f"available steps: {steps or 'none'}.")
    algorithm = registry.get(cfg.algo.name)
    spec = algorithm.model(cfg.algo, cfg.model)
    optimizer = train_optimizer(cfg.optim, cfg.model, algorithm.optimizer(cfg.algo),
                                cfg.train.steps)
    scaling = scaling_for(cfg.model, cfg.optim)
    place = placement(spec, optimizer, trainer_mesh(MeshConfig(data=1, fsdp=-1)),
                      cfg.mesh.train_rules, scaling)
    state, _ = ckpt.restore(step, checkpointed(place, place.abstract_state),
                            checkpointed(place, place.state))
    ckpt.close()
    # A LoRA checkpoint holds the adapters; the base comes from the model's checkpoint
    # (or its seeded random init), as when the run started.
    state = complete(place, state, make_init(spec, optimizer, place, cfg.train.seed,
                                             lambda: load_initial(spec, place.state.params),
                                             scaling))
    if not language_model:
        return cfg, state.params
    if spec.policy is None:
        raise ConfigError(f"{run} trained a reward model (algo={cfg.algo.name}), which does not "
                          f"generate text; export it with `gpurl export` and use it as "
                          f"algo.reward_model.")
    return cfg, spec.policy_params(state.params)

"""`gpurl export`: a run directory's newest (or a chosen) checkpoint -> an HF directory.

The run's config.yaml gives the architecture, the Orbax checkpoint the parameters
(restored sharded over the local devices), and the tokenizer is the one the run used.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from gpurl.config import Config, ConfigError, MeshConfig, from_dict
from gpurl.distributed.mesh import trainer_mesh
from gpurl import algorithms
from gpurl.models import Params, loading, lora
from gpurl.models.scalar import load_initial
from gpurl.models.tokenizer import load_tokenizer, save_tokenizer
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.optim import make_train_optimizer
from gpurl.train.step import checkpointed, complete, make_init, placement


def restore_run(run_dir: str | Path, step: int | None = None,
                language_model: bool = True) -> tuple[Config, Params]:
    """A run's config and the parameters of its newest (or given) checkpoint, sharded over
    every local device (never whole on one device). With `language_model`, the language
    model inside them (PPO's policy); otherwise the whole trained tree."""
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
    spec = algorithms.model(cfg, cfg.model)
    optimizer = make_train_optimizer(cfg)
    place = placement(spec, optimizer, mesh, cfg.mesh.train_rules)
    state, _ = ckpt.restore(step, checkpointed(place, place.abstract_state),
                            checkpointed(place, place.state))
    ckpt.close()
    # A LoRA checkpoint holds the adapters; the base comes from the model's checkpoint
    # (or its seeded random init), as when the run started.
    state = complete(place, state, make_init(spec, optimizer, place, cfg.train.seed, lambda: (
        load_initial(spec, place.state.params, loading.load_params))))
    if not language_model:
        return cfg, state.params
    if algorithms.policy_spec(spec) is None:
        raise ConfigError(f"{run} trained a reward model (algo=rm), which does not generate "
                          f"text; export it with `gpurl export` and use it as algo.reward_model.")
    return cfg, algorithms.policy_params(spec, state.params)


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               adapter: bool = False) -> Path:
    """Writes config.json, model.safetensors and the tokenizer of `run_dir` into `out_dir`:
    the language model (PPO: the policy, not the critic), or for an algo=rm run the reward
    model as an HF ...ForSequenceClassification directory. A LoRA run's adapters are merged
    into the base, or with `adapter` written alone in PEFT's layout."""
    from gpurl.models.hf_export import export_hf
    from gpurl.models.scalar import export_scalar_hf

    cfg, params = restore_run(run_dir, step, language_model=False)
    if adapter or cfg.model.lora.rank:
        return _export_lora(cfg, params, Path(out_dir), adapter)
    if cfg.algo.name == "rm":
        out = export_scalar_hf(params, cfg.model, out_dir)
    else:
        out = export_hf(algorithms.policy_params(algorithms.model(cfg, cfg.model), params),
                        cfg.model, out_dir)
    save_tokenizer(load_tokenizer(cfg.model), out)
    return Path(out)


def _export_lora(cfg: Config, params: Params, out: Path, adapter: bool) -> Path:
    from gpurl.models.hf_export import export_hf
    from gpurl.models.scalar import export_scalar_hf

    if not cfg.model.lora.rank:
        raise ConfigError("adapter=true exports LoRA adapters, but the run trained with "
                          "model.lora.rank=0; export it without adapter=true.")
    model = "backbone" if cfg.algo.name == "rm" else None
    spec = algorithms.model(cfg, cfg.model)
    lm = params[model] if model else algorithms.policy_params(spec, params)
    if adapter:
        if model:
            raise ConfigError("adapter=true writes a causal-LM adapter, but this run trained a "
                              "reward model (algo=rm); export it without adapter=true.")
        out = lora.export_peft(lm, cfg.model, out, cfg.model.checkpoint)
    else:
        merged, base_cfg = lora.merged(lm, cfg.model), lora.base_config(cfg.model)
        out = (export_scalar_hf({**params, model: merged}, base_cfg, out) if model
               else export_hf(merged, base_cfg, out))
    save_tokenizer(load_tokenizer(cfg.model), out)
    return out

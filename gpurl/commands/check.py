"""`gpurl check COMMAND [overrides] [processes=N] [devices=N]`: every start-up check of
`gpurl train` (or plan, eval, generate) on a command line, without loading a model or
touching a device, for a job of N processes with N devices each.

What a real start would refuse, refused here with the same sentence: the composed config
(done by the command line before this module runs), the trainer and rollout meshes over
the job's devices, batch sizes against processes and batch shards, a Slurm allocation
started without srun, the files the config names (checkpoints, data, teacher, reward
model, run directories, prompt files), reward functions and environments (user code is
imported). Memory is `gpurl plan`'s question, not this one's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from gpurl import hub
from gpurl.algorithms import registry
from gpurl.algorithms.registry import Family
from gpurl.commands.plan import planned_config
from gpurl.commands.serve import serve_checks
from gpurl.serve.agents import check_agent
from gpurl.config import Config, ConfigError, EvalConfig, GenerateConfig, ServeConfig
from gpurl.data import suites
from gpurl.data.batching import check_processes
from gpurl.data.sources import default_rewards
from gpurl.distributed import runtime
from gpurl.distributed.mesh import batch_shards, mesh_sizes, rollout_per_process, rollout_shards
from gpurl.models import loading
from gpurl.rewards import from_config as load_rewards
from gpurl.rollout.multiturn import EnvFactory
from gpurl.rollout.rounds import check_rows
from gpurl.train.loop import check_batch, check_context, check_experts, check_target


def job_shape(distributed: Any, processes: int | None, devices: int | None,
              planned: int = 0) -> tuple[int, int]:
    """(processes, devices per process) of the job being checked: the arguments, else
    Slurm's task count or distributed.num_processes, and one device per process when there
    are several (one process per GPU), else this machine's device count. `planned`: the
    devices `gpurl plan plan.devices=N` lays the run out on (one process)."""
    if planned and processes is None and devices is None:
        return 1, planned
    if processes is None:
        slurm = os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS")
        processes = distributed.num_processes or (int(slurm) if slurm else 1)
    if devices is None:
        import jax  # noqa: PLC0415 - only when the job's devices are this machine's

        devices = 1 if processes > 1 else jax.local_device_count()
    if processes < 1 or devices < 1:
        raise ConfigError(f"processes={processes} devices={devices} is not a job; give "
                          f"processes=N and devices=N of at least 1.")
    return processes, devices


def check(command: str, cfg: Any, processes: int, devices: int) -> list[str]:
    """The checks of `command` on `cfg` (its composed, converted config) for a job of
    `processes` x `devices`; one line per check passed, ConfigError at the first failure."""
    if "SLURM_STEP_NUM_TASKS" not in os.environ:
        runtime.wants_multiprocess(cfg.distributed)  # an allocation started without srun
    lines = [f"job: {processes} process(es) x {devices} device(s)"]
    lines += CHECKS[command](cfg, processes, devices)
    return lines


def _plan(cfg: Config, processes: int, devices: int) -> list[str]:
    return _train(planned_config(cfg), processes, devices, planning=True)


def _train(cfg: Config, processes: int, devices: int, planning: bool = False) -> list[str]:
    if not planning:
        check_target(cfg)
    algorithm = registry.get(cfg.algo.name)
    check_context(cfg, algorithm)
    total = processes * devices
    lines = []
    trainer, rollout = total, total
    if algorithm.family == Family.RL and cfg.mesh.placement == "split":
        per = rollout_per_process(cfg.mesh, [devices] * processes)
        trainer, rollout = total - per * processes, per * processes
        lines.append(f"placement: split, {rollout} rollout and {trainer} trainer devices")
    shape = mesh_sizes(cfg.mesh, trainer)
    check_batch(cfg, batch_shards(shape, cfg.mesh.train_rules))
    check_experts(cfg.model, shape, cfg.mesh.train_rules)
    lines.append(f"trainer mesh {shape}, micro-batch {cfg.train.batch_size // cfg.train.num_micro_batches} "
                 f"x {cfg.train.num_micro_batches}")
    if algorithm.family == Family.RL:
        shards = rollout_shards(cfg.mesh, rollout)
        check_rows(cfg.train.batch_size, cfg.algo.num_generations, processes, shards)
        lines.append(f"rollout: {cfg.train.batch_size} prompts x {cfg.algo.num_generations} "
                     f"over {processes} process(es) and {shards} data shard(s)"
                     + (" (mesh.rollout_tp=auto taken as 1)" if cfg.mesh.rollout_width is None
                        else ""))
    else:
        check_processes(cfg.train.batch_size, processes)
    lines.append(_model_line(cfg.model))
    for key in ("teacher", "reward_model"):
        path = getattr(cfg.algo, key, None)
        if path is not None:
            lines.append(_exists(f"algo.{key}", path))
    lines += _data(cfg.data)
    for name in cfg.train.suites:  # names and the algorithm checked by check_context
        lines.append(f"train.suites {name}: "
                     + hub.describe(suites.get(name).dataset, f"train.suites ({name})", "dataset"))
    if algorithm.family == Family.RL:
        lines += _task(cfg)
    return lines


def _eval(cfg: EvalConfig, processes: int, devices: int) -> list[str]:
    lines = []
    if cfg.checkpoint is not None:
        lines.append(_run_dir(cfg.checkpoint))
    else:
        lines.append(_model_line(cfg.model))
    rollout_shards(cfg.mesh, processes * devices)
    if cfg.suite:  # the suites' own rows and scorers (names checked by `to_config`)
        lines.append(f"suites: {', '.join(cfg.suite)}")
        return lines + ([_exists("suite_path", cfg.suite_path)] if cfg.suite_path else [])
    return lines + _data(cfg.data) + _task(cfg)


def _generate(cfg: GenerateConfig, processes: int, devices: int) -> list[str]:
    lines = [_run_dir(cfg.checkpoint) if cfg.checkpoint is not None else _model_line(cfg.model)]
    rollout_shards(cfg.mesh, processes * devices)
    if cfg.prompts_file is not None:
        lines.append(_exists("prompts_file", cfg.prompts_file))
    if cfg.env.on:
        EnvFactory(cfg.env)
        lines.append(f"env: {cfg.env.name}")
        if cfg.prompt is None and cfg.prompts_file is None:
            lines += _data(cfg.data)
    return lines


def _serve(cfg: ServeConfig, processes: int, devices: int) -> list[str]:
    lines = [_run_dir(cfg.checkpoint) if cfg.checkpoint is not None else _model_line(cfg.model)]
    rollout_shards(cfg.mesh, processes * devices)
    return lines + serve_checks(cfg, processes)


CHECKS: dict[str, Callable[[Any, int, int], list[str]]] = {
    "train": _train, "plan": _plan, "eval": _eval, "generate": _generate, "serve": _serve}


def _model_line(model: Any) -> str:
    """The weights a start would load, read from the cache only (nothing is fetched)."""
    named = loading.weights_name(model)
    if named is not None and not hub.is_hub_id(named[0]):
        named = (loading.checkpoint_path(model), named[1])
    return (f"model: {model.name}, "
            + (f"weights {hub.describe(*named)}" if named else "random weights"))


def _exists(key: str, path: str) -> str:
    if hub.is_hub_id(path):
        return f"{key}: {hub.describe(path, key)}"
    if not Path(path).expanduser().exists():
        raise ConfigError(f"{key}={path} does not exist; point it at an existing path.")
    return f"{key}: {path}"


def _run_dir(run_dir: str) -> str:
    if not (Path(run_dir) / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} holds no config.yaml; point checkpoint= at a gpurl run "
                          f"directory.")
    return f"checkpoint: run {run_dir}"


def _data(data: Any) -> list[str]:
    lines = [_exists(f"data.{key}", getattr(data, key)) for key in ("path", "eval_path")
             if getattr(data, key) is not None]
    if data.dataset is not None and data.path is None:
        lines.append(f"data.dataset: {hub.describe(data.dataset, 'data.dataset', 'dataset')}")
    return lines


def _task(cfg: Any) -> list[str]:
    """The reward functions import and the environment (and its tools) or the agent load."""
    rewards = load_rewards(cfg.rewards, [] if cfg.env.on else default_rewards(cfg.data))
    lines = [f"rewards: {', '.join(r.name for r in rewards) or 'the environment'}"]
    if cfg.env.agents:
        lines.append(f"env: agent {check_agent(cfg.env)}")
    elif cfg.env.on:
        EnvFactory(cfg.env)
        lines.append(f"env: {cfg.env.name}")
    return lines

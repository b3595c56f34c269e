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

import yaml

from gpurl.commands.plan import plan_checks, planned_config
from gpurl.commands.serve import serve_checks
from gpurl.config import Config, ConfigError, ServeConfig
from gpurl.distributed import runtime
from gpurl.distributed.mesh import rollout_shards
from gpurl.train.preflight import (eval_checks, generate_checks, model_line, run_dir,
                                   train_checks)


def launched_processes(overrides: list[str], config_dir: Path) -> int | None:
    """The processes of each job `hydra/launcher=slurm` submits (hydra.launcher.nodes x
    tasks_per_node, the launcher config's defaults under the command line's), else None."""
    launcher = next((a.partition("=")[2] for a in overrides if a.startswith("hydra/launcher=")), None)
    path = config_dir / "hydra" / "launcher" / f"{launcher}.yaml"
    if launcher is None or not path.is_file():
        return None
    sizes = {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items()
             if k in ("nodes", "tasks_per_node")}
    for arg in overrides:
        key, _, value = arg.partition("=")
        name = key.removeprefix("+").removeprefix("hydra.launcher.")
        if key.lstrip("+").startswith("hydra.launcher.") and name in ("nodes", "tasks_per_node"):
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{arg} is not a count; give {key}=N with N at least 1.")
            sizes[name] = int(value)
    return int(sizes.get("nodes") or 1) * int(sizes.get("tasks_per_node") or 1)


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
    lines = plan_checks(cfg, processes)
    return lines + train_checks(planned_config(cfg), processes, devices, planning=True)


def _serve(cfg: ServeConfig, processes: int, devices: int) -> list[str]:
    lines = [run_dir(cfg.checkpoint) if cfg.checkpoint is not None else model_line(cfg.model)]
    rollout_shards(cfg.mesh, processes * devices)
    return lines + serve_checks(cfg, processes)


CHECKS: dict[str, Callable[[Any, int, int], list[str]]] = {
    "train": train_checks, "plan": _plan, "eval": eval_checks, "generate": generate_checks,
    "serve": _serve}

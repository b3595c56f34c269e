"""`gpurl plan`: the memory plan of a `gpurl train` command (same overrides), printed and
nothing allocated. Every program the run would compile (the train step; for RL the
rollout round) is compiled ahead of time for the mesh the run would use, from abstract
arrays, and XLA's memory analysis is split into the parts a user can act on.

On a CPU machine `plan.devices=N` simulates N devices, so the plan of an 8-GPU run can be
made on a laptop; the CPU compiler's figures are not a GPU's but of the same order (see
docs/scaling.md). `plan.target=h100` (with JAX's CUDA plugin installed: the `gpu-plan`
extra) compiles instead with XLA's GPU compiler for N compile-only H100s
(`gpurl.plan.targets`): the programs a GPU would run (cuDNN attention, Triton
kernels, bf16), their real GPU memory analysis, and no GPU needed. A preset without
weights is planned from its architecture alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Iterator

import jax

from gpurl.config import Config, ConfigError, PlanConfig
from gpurl.distributed import runtime
from gpurl.kernels import platform
from gpurl.models.loading import PACKAGED
from gpurl.models.transformer import remat_policy
from gpurl.plan import efficiency, targets
from gpurl.train.loop import build
from gpurl.train.preflight import default_batch, train_checks
from gpurl.plan.memory import GIB, ProgramPlan, advice
from gpurl.train.fitting import fitted
from gpurl.train.stepper import Setup, Stepper

# plan.devices without plan.device_memory_gb: the simulated devices are GPUs of this size
# (H100 / A100 80 GB), not this host's RAM.
SIMULATED_DEVICE_GB = 80.0


def simulate_devices(devices: int) -> None:
    """Makes JAX's CPU backend expose `devices` devices; must run before JAX starts."""
    jax.config.update("jax_platforms", "cpu")
    try:
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:
        if jax.device_count() != devices:
            raise ConfigError(
                f"plan.devices={devices} needs a fresh process, but JAX already started with "
                f"{jax.device_count()} devices; run `gpurl plan` on its own.") from None


def start_backend(cfg: PlanConfig) -> None:
    """Before JAX starts: plan.target compiles for GPUs and runs on none (the CPU backend,
    so a CUDA plugin is never initialized); plan.devices simulates that many CPU devices."""
    if cfg.target:
        targets.gpu(cfg.target)  # a known GPU
        jax.config.update("jax_platforms", "cpu")
    elif cfg.devices:
        simulate_devices(cfg.devices)


def planned_config(cfg: Config) -> Config:
    """The config `gpurl plan` compiles: simulated GPUs take their defaults (bf16, full
    remat, 80 GiB), and a preset without weights is planned from its architecture."""
    model = cfg.model
    if cfg.plan.devices or cfg.plan.target:  # (simulated) GPUs: their defaults, not the CPU's
        model = dataclasses.replace(model, dtype="bfloat16" if model.dtype == "auto" else model.dtype,
                                    remat="full" if model.remat == "auto" else model.remat)
    if cfg.plan.devices and not cfg.plan.target:
        cfg = dataclasses.replace(cfg, plan=dataclasses.replace(
            cfg.plan, device_memory_gb=cfg.plan.device_memory_gb or SIMULATED_DEVICE_GB))
    if model.init != "random" and model.checkpoint is None and model.name not in PACKAGED:
        model = dataclasses.replace(model, init="random")  # only the shapes matter
    return dataclasses.replace(cfg, model=model)


def plan_checks(cfg: Config, processes: int) -> list[str]:
    """The checks of a `gpurl plan` start before its run's own (`gpurl check plan` too): a
    known plan.target, planned in one process."""
    if not cfg.plan.target:
        return []
    gpu = targets.gpu(cfg.plan.target)
    if processes > 1:
        raise ConfigError("plan.target compiles for GPUs this machine does not have, in one "
                          "process; run `gpurl plan` without srun or distributed.* keys.")
    return [f"plan.target: {gpu.description}, compile-only"]


@contextlib.contextmanager
def compiled_for(cfg: Config) -> Iterator[None]:
    """With plan.target: meshes of compile-only GPUs of that kind, traced with a GPU's
    choices (`platform.target`) and compiled by XLA's GPU compiler; else nothing changes."""
    if not cfg.plan.target:
        yield
        return
    gpu = targets.gpu(cfg.plan.target)
    with targets.compile_only(gpu, cfg.plan.devices or 1), platform.target("gpu", gpu.capability):
        yield


def plan_programs(cfg: Config) -> tuple[Config, Setup, list[ProgramPlan],
                                        efficiency.RLBound | None]:
    """(the resolved config, what the run builds, the plan of each of its programs, the
    GPU compiler's bound on an RL step: plan.target only)."""
    with compiled_for(cfg):
        def prepare(stepper: Stepper) -> None:
            if cfg.plan.prompt_len:
                stepper.plan_prompt_len(cfg.plan.prompt_len)

        cfg, setup, stepper, plans = fitted(planned_config(cfg), build, prepare)
        bound = (efficiency.accounts(cfg, setup, stepper, plans, targets.gpu(cfg.plan.target))
                 if cfg.plan.target else None)
        return cfg, setup, plans, bound


def plan(cfg: Config, preset_batch: bool = False) -> list[ProgramPlan]:
    """Prints one table per program of the run `cfg` describes; returns the plans.
    `preset_batch`: as `gpurl.train.loop.train`'s."""
    start_backend(cfg.plan)
    runtime.initialize(cfg.distributed)
    processes, devices = runtime.job_shape()
    devices = cfg.plan.devices or (1 if cfg.plan.target else devices)  # planned on
    plan_checks(cfg, processes)
    if preset_batch:
        cfg, line = default_batch(cfg, processes, devices)
        if line and runtime.is_main_process():
            print(f"[gpurl] plan: {line}", flush=True)
    train_checks(planned_config(cfg), processes, devices, planning=True)
    t0 = time.perf_counter()
    cfg, setup, plans, bound = plan_programs(cfg)
    total_s = time.perf_counter() - t0
    if runtime.is_main_process():
        devices = setup.place.mesh.devices
        kind = (f"{targets.gpu(cfg.plan.target).description} (compile-only, plan.target="
                f"{cfg.plan.target})" if cfg.plan.target else devices.flat[0].platform)
        print(f"[gpurl] plan: {cfg.algo.name} on {cfg.model.name}, trainer mesh "
              f"{dict(setup.place.mesh.shape)} of {devices.size} {kind} "
              f"device(s), model.dtype={cfg.model.dtype}, model.remat="
              f"{remat_policy(cfg.model)}; {total_s:.1f} s in all", flush=True)
        for p in plans:
            print(p.table(), flush=True)
        if bound is not None:
            print(f"[gpurl] plan: {bound.line(targets.gpu(cfg.plan.target))}", flush=True)
        worst = max(plans, key=lambda p: p.total / p.limit)
        print(f"[gpurl] plan: {'fits' if all(p.fits for p in plans) else 'does NOT fit'} "
              f"(largest program: {worst.name}, {worst.total / GIB:.2f} of "
              f"{worst.limit / GIB:.1f} GiB per device)", flush=True)
        for p in plans:
            if not p.fits:
                print(f"[gpurl] plan: {advice(cfg, p)}", flush=True)
        if cfg.plan.json:
            Path(cfg.plan.json).write_text(json.dumps(record(cfg, plans, bound), indent=1,
                                                      default=str))
            print(f"[gpurl] plan: wrote {cfg.plan.json}", flush=True)
    return plans


def record(cfg: Config, plans: list[ProgramPlan],
           bound: efficiency.RLBound | None) -> dict[str, Any]:
    """plan.json's content: the resolved config, each program's memory per device (GiB, by
    part) and, with plan.target, the RL step's bound with each program's account."""
    gpu = targets.gpu(cfg.plan.target) if cfg.plan.target else None
    return {"config": dataclasses.asdict(cfg),
            "target": gpu.description if gpu else None,
            "target_peak": ({"bf16_flops": gpu.bf16_flops, "bandwidth": gpu.bandwidth}
                            if gpu else None),
            "memory": [{"program": p.name, "gib": p.total / GIB, "limit_gib": p.limit / GIB,
                        "fits": p.fits, "parts_gib": {k: v / GIB for k, v in p.parts.items()}}
                       for p in plans],
            "rl_step": bound.record(gpu) if bound is not None and gpu else None}

"""A run fitted to its devices: built with the trainer's own builders, every program it runs
(the train step; for RL the rollout round) compiled ahead of time for the mesh the run uses
(`gpurl.plan.memory` splits their memory), and the `auto` keys that depend on what fits
resolved (mesh.context, train.micro_batch_tokens, rollout.kv_cache_tokens).

`gpurl plan` prints the plans. `gpurl train` computes them before it allocates anything,
runs the programs it compiled for them (no second compile) and, when one does not fit,
stops with one sentence naming the largest part and the cheapest fixes, never a kill by
the kernel.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax

from gpurl.config import Config, ConfigError
from gpurl.distributed import layout, runtime
from gpurl.distributed.mesh import abstract, batch_divisor, shard_bytes, sharded
from gpurl.kernels.pallas_grouped import OffsetLimitError
from gpurl.plan.memory import (GIB, ProgramPlan, device_memory, kv_cap, memory_of, on_gpu,
                               plan_rollout, splits_rows)
from gpurl.plan.programs import Kind, RolloutRound
from gpurl.train.optim import frozen_patterns, trainable
from gpurl.train.step import Placement, Program
from gpurl.train.stepper import Setup, Stepper


def plan_train_step(step: Program, place: Placement, batch: dict[str, Any], freeze: tuple,
                    resident: float, limit: float, teacher: Any = None) -> ProgramPlan:
    """Compiles the train step (which the run then uses) and splits its memory: state parts
    from the shardings, gradients from the trainable parameters, a distillation teacher
    (`TeacherWeights`), the rest of the scratch as activations."""
    state = abstract(place.abstract_state, place.state)
    batch = sharded(batch, place.batch)
    t0 = time.perf_counter()
    compiled = step.compile(state, batch, None if teacher is None else teacher.abstract)
    compile_s = time.perf_counter() - t0
    args, temp, outputs = memory_of(compiled)
    params = shard_bytes(place.abstract_state.params, place.state.params)
    opt = shard_bytes(place.abstract_state.opt_state, place.state.opt_state)
    train = trainable(place.abstract_state.params, freeze)
    if place.frozen is not None:
        train = jax.tree.map(lambda t, f: t and not f, train, place.frozen)
    grads = shard_bytes([x for x, t in zip(jax.tree.leaves(place.abstract_state.params),
                                           jax.tree.leaves(train)) if t],
                        [s for s, t in zip(jax.tree.leaves(place.state.params),
                                           jax.tree.leaves(train)) if t])
    grads = min(grads, temp)
    teacher_bytes = 0.0 if teacher is None else teacher.bytes_per_device()
    parts = {"parameters": params, "optimizer state": opt, "gradients": grads,
             "activations / scratch": temp - grads + outputs,
             "inputs": max(args - params - opt - teacher_bytes, 0.0), "resident": resident}
    if teacher is not None:  # a distillation teacher: one of the step's arguments
        parts["teacher"] = teacher_bytes
    return ProgramPlan(Kind.TRAIN, parts, compile_s, limit,
                       gpu_programs=on_gpu({Kind.TRAIN: compiled}, place.mesh),
                       analysis={"arguments": args, "temp": temp, "outputs": outputs})


Built = tuple[Config, Setup, Stepper]


def fitted(cfg: Config, build: Callable[[Config], Built],
           prepare: Callable[[Stepper], None] = lambda stepper: None, check: bool = True
           ) -> tuple[Config, Setup, Stepper, list[ProgramPlan]]:
    """`build(cfg)` (then `prepare(stepper)`) and, with `check`, the memory plan of its
    programs (`memory_plan`). mesh.context=auto: 1, or, when the train step's activations
    do not fit at the narrowest budget there, the narrowest wider context (fsdp's devices
    first, `layout.wider_contexts`) whose train step fits: one build and plan per width
    tried, said in the plan's `chosen`; without `check`, 1."""
    auto = cfg.mesh.context_width is None
    if auto:
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, context="1"))
    built = build(cfg)
    prepare(built[2])
    if not check:
        return *built, []
    train = _train_plan(*built)
    wider = (layout.wider_contexts(built[0].mesh, dict(built[1].place.mesh.shape))
             if auto and splits_rows(cfg) else [])
    tried = []
    for mesh in wider:
        if train.fits or train.largest()[0] != "activations / scratch":
            break
        tried.append(f"{built[0].mesh.context_width}: {train.total / GIB:.1f}")
        if runtime.is_main_process():  # a build and a compile per width: say why
            print(f"[gpurl] plan: the train step needs {train.total / GIB:.1f} of "
                  f"{train.limit / GIB:.1f} GiB per device at mesh.context="
                  f"{built[0].mesh.context_width} (auto); planning mesh.context="
                  f"{mesh.context_width}", flush=True)
        built = build(dataclasses.replace(cfg, mesh=mesh))
        prepare(built[2])
        train = _train_plan(*built)
    if auto and not tried and splits_rows(cfg):
        why = ("the train step fits without splitting rows" if train.fits else
               "no devices are left to split rows over" if not wider else
               f"splitting rows would not shrink the largest part, {train.largest()[0]}")
        train.chosen.insert(0, f"mesh.context=auto -> 1 ({why})")
    if tried:
        mesh = built[0].mesh
        train.chosen.insert(0, (
            f"mesh.context=auto -> {mesh.context_width} with mesh.fsdp={mesh.fsdp} mesh.data="
            f"{mesh.data} (the train step at the narrowest budget did not fit at width "
            f"{', '.join(tried)} GiB per device)"))
    return *built, memory_plan(*built, train)


def _train_plan(cfg: Config, setup: Setup, stepper: Stepper) -> ProgramPlan:
    """The train step's plan; train.micro_batch_tokens=0: at the budget that fits
    (`_fit_budget`)."""
    limit = _limit(cfg, setup)[0]

    def train_plan() -> ProgramPlan:
        return plan_train_step(setup.step_fn, setup.place, stepper.batch_spec(),
                               frozen_patterns(cfg.optim, cfg.model),
                               stepper.resident_bytes(), limit, setup.teacher)

    auto = cfg.train.packed and hasattr(stepper, "budget") and cfg.train.micro_batch_tokens == 0
    train = _within_kernel_limits(stepper, train_plan) if auto else train_plan()
    if cfg.train.packed and hasattr(stepper, "budget"):
        if cfg.train.micro_batch_tokens == 0:
            train = _fit_budget(stepper, train, train_plan)
        train.micro_rows = stepper.batch_spec()["pack/tokens"].shape[0] // stepper.shards
    return train


def _within_kernel_limits(stepper: Stepper, train_plan: Callable[[], ProgramPlan]) -> ProgramPlan:
    """train.micro_batch_tokens=0 (auto): the train step's plan at the padded micro-batch's
    budget, or, when a kernel cannot address a call that large (`OffsetLimitError`: the
    Pallas grouped matmul's 32-bit offsets), at a budget shrunk by the factor it names
    (at least one row), said in the plan's `chosen`."""
    first = stepper.budget
    for _ in range(16):  # each try at most 0.95 of the last budget's, down to one row
        try:
            plan = train_plan()
        except OffsetLimitError as e:
            if e.scale is None:
                raise
            if stepper.budget == 1:
                raise ConfigError(
                    f"even one row per micro-batch and device is more token copies than the "
                    f"Pallas grouped matmul's 32-bit offsets address ({e.rows:,} of at most "
                    f"{int(e.rows * e.scale):,}); split each row over devices with "
                    f"mesh.context=2 or more, or set model.moe.grouped_matmul=ragged.") from None
            stepper.budget = max(min(int(stepper.budget * e.scale * 0.95), stepper.budget - 1), 1)
            continue
        if stepper.budget != first:
            plan.chosen.append(f"train.micro_batch_tokens=0 (auto) -> {stepper.budget:,} tokens per "
                               f"micro-batch and device (the padded micro-batch's {first:,} "
                               f"exceeded the Pallas grouped matmul's 32-bit offsets)")
        return plan
    return train_plan()


def _limit(cfg: Config, setup: Setup) -> tuple[float, str]:
    """(bytes of one of this process's devices, where the figure comes from)."""
    local = [d for d in setup.place.mesh.devices.flat if d.process_index == jax.process_index()]
    return device_memory(cfg.plan, local[0])


def memory_plan(cfg: Config, setup: Setup, stepper: Stepper,
                train: ProgramPlan | None = None) -> list[ProgramPlan]:
    """Every program of the run compiled for its mesh from abstract arrays (the train
    step, planned already or here, and for RL the rollout round), nothing allocated."""
    limit, source = _limit(cfg, setup)
    train = train or _train_plan(cfg, setup, stepper)
    round_ = stepper.rollout_round()
    rollout = None if round_ is None else plan_rollout(round_, limit)
    if rollout is not None and cfg.rollout.kv_cache_tokens == 0:
        rollout = _fit_pool(round_, rollout, limit)
    plans = [train] + [p for p in [rollout] if p is not None]
    mesh = setup.place.mesh  # the rollout's resident part is the train state: its mesh
    for p in plans:
        p.devices, p.fsdp = mesh.size, mesh.shape["fsdp"]
        p.batch_shards = batch_divisor(mesh, cfg.mesh.train_rules)
        p.context = mesh.shape["context"]
        p.notes.append(f"device memory: {source}")
    return plans


def _fit_budget(stepper: Stepper, plan: ProgramPlan,
                replan: Callable[[], ProgramPlan]) -> ProgramPlan:
    """train.micro_batch_tokens=0 (auto): the padded micro-batch's budget, or, when the
    train step's activations do not fit beside the rest, the largest budget that does
    (activations scale with a micro-batch's tokens; at least one row; up to three
    compiles to confirm), said in the plan's `chosen`."""
    first = stepper.budget
    for _ in range(3):
        if plan.fits or plan.largest()[0] != "activations / scratch" or stepper.budget == 1:
            break
        act = plan.parts["activations / scratch"]
        room = plan.limit - (plan.total - act)
        fitted = max(int(0.9 * room * _micro_tokens(stepper) / act), 1) if room > 0 else 1
        stepper.budget = fitted if fitted < stepper.budget else max(stepper.budget // 2, 1)
        plan = replan()
    if stepper.budget != first:
        plan.chosen.append(f"train.micro_batch_tokens=0 (auto) -> {stepper.budget:,} tokens per "
                           f"micro-batch and device ({_micro_tokens(stepper):,} planned at the "
                           f"longest rows; the padded micro-batch's {first:,} did not fit)")
    return plan


def _micro_tokens(stepper: Stepper) -> int:
    """Tokens per device of the planned micro-batch (rows of the longest length)."""
    rows, length = stepper.batch_spec()["pack/tokens"].shape
    return max(rows // stepper.shards * length // stepper.context, 1)


def _fit_pool(round_: RolloutRound, plan: ProgramPlan, limit: float) -> ProgramPlan:
    """rollout.kv_cache_tokens=0 (auto): the pool for every slot's longest request, or,
    when it does not fit beside the rest, the largest cap that does (`kv_cap`; the
    scheduler queues the requests the pool cannot hold), said in the plan's `chosen`."""
    if plan.fits or plan.largest()[0] != "KV cache" or not plan.kv_tokens:
        return plan
    cap = kv_cap(plan, plan.limit - (plan.total - plan.parts["KV cache"]))
    if cap < plan.request_tokens:
        return plan  # not one request: the advice says what else to change
    round_.engine.cfg = dataclasses.replace(round_.engine.cfg, kv_cache_tokens=cap)
    new = plan_rollout(round_, limit)
    new.chosen.append(f"rollout.kv_cache_tokens=0 (auto) -> {cap:,} tokens per rollout data "
                      f"shard ({cap // plan.request_tokens} of the longest requests at once; "
                      f"the pool for every slot, {plan.parts['KV cache'] / GIB:.1f} GiB per "
                      f"device, did not fit)")
    return new



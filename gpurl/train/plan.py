"""The memory plan of a run: every program it runs (the train step; for RL the rollout)
compiled ahead of time for the mesh the run uses, from abstract arrays, with XLA's memory
analysis split into the parts a user can act on, and checked against a device's memory.

`gpurl plan` prints it. `gpurl train` computes it before it allocates anything, runs the
programs it compiled for it (no second compile) and, when one does not fit, stops with one
sentence naming the largest part and the cheapest fixes, never a kill by the kernel.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax

from gpurl.algorithms import registry
from gpurl.algorithms.registry import Family
from gpurl.buckets import three_bits
from gpurl.config import Config, ConfigError, PlanConfig
from gpurl.distributed import host, layout, runtime, targets
from gpurl.distributed.mesh import abstract, batch_divisor, held_bytes, shard_bytes, sharded
from gpurl.models.transformer import remat_policy
from gpurl.rollout.engine import Engine
from gpurl.train.optim import trainable
from gpurl.train.step import Placement, Program
from gpurl.train.stepper import Setup, Stepper

GIB = 2**30
PARTS = ("parameters", "optimizer state", "gradients", "activations / scratch", "KV cache",
         "KV cache (evaluation)", "teacher", "inputs", "resident")


# Custom calls of a GPU program that name the kernel a user chose (or `auto` chose)
GPU_KERNELS = {"__cudnn$fmha": "cuDNN flash attention", "__gpu$xla.gpu.triton": "Pallas (Triton)",
               "__cublas$gemm": "cuBLAS matmul"}
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def kernel_note(compiled: list[Any]) -> str:
    """A note counting the calls of each kernel library GPU programs run (cuDNN attention,
    Pallas kernels compiled by Triton, the experts' grouped matmul): what `auto` picked, and
    the `jax.lax.ragged_dot` matmuls XLA expanded to every expert, if any."""
    counts: dict[str, int] = {}
    for c in compiled:
        for line in c.as_text().splitlines():
            call = _CUSTOM_CALL.search(line)
            if call is not None:
                kernel = next((k for p, k in GPU_KERNELS.items() if call.group(1).startswith(p)), None)
                if kernel == "Pallas (Triton)" and "gpurl_grouped_" in line:
                    kernel = "Pallas grouped matmul (Triton)"
            elif " dot(" in line and "ragged_dot" in line:
                kernel = "ragged_dot expanded to every expert by XLA"
            else:
                continue
            if kernel is not None:
                counts[kernel] = counts.get(kernel, 0) + 1
    listed = ", ".join(f"{k} x{n}" for k, n in counts.items()) or "XLA's own fusions only"
    return f"GPU kernels: {listed}"


@dataclass
class ProgramPlan:
    """One compiled program's memory per device, in bytes, by part."""

    name: str
    parts: dict[str, float]
    compile_s: float
    limit: float  # bytes of one device
    devices: int = 1  # devices of the program's mesh
    fsdp: int = 1  # of which along mesh.fsdp
    batch_shards: int = 1  # a micro-batch's rows are a multiple of it
    context: int = 1  # devices along mesh.context
    kv_tokens: int = 0  # the rollout's KV pool, in tokens per rollout data shard
    kv_block: int = 0  # tokens per block of that pool
    chosen: list[str] = field(default_factory=list)  # what the plan picked for an auto key
    micro_rows: int = 0  # packed rows per micro-batch and batch shard (train step; 0: not packed)
    request_tokens: int = 0  # the rollout's longest request (prompt + completion)
    notes: list[str] = field(default_factory=list)
    analysis: dict[str, float] = field(default_factory=dict)  # XLA's: arguments, temp, outputs
    gpu_programs: list[Any] = field(default_factory=list, repr=False)  # compiled for a GPU
    account: list[str] = field(default_factory=list)  # the GPU compiler's (`efficiency`)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def largest(self) -> tuple[str, float]:
        return max(self.parts.items(), key=lambda kv: kv[1])

    def table(self) -> str:
        rows = [(p, self.parts[p]) for p in PARTS if p in self.parts] + [("total", self.total)]
        width = max(len(r[0]) for r in rows)
        lines = [f"{self.name} (GiB per device; compiled in {self.compile_s:.1f} s)"]
        lines += [f"  {name:<{width}}  {value / GIB:10.3f}" for name, value in rows]
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"  {'device memory':<{width}}  {self.limit / GIB:10.3f}  -> {verdict}")
        notes = (self.chosen + self.notes
                 + ([kernel_note(self.gpu_programs)] if self.gpu_programs else []))
        lines += [f"  ({note})" for note in notes]
        lines += [f"  {line}" for line in self.account]
        return "\n".join(lines)


def device_memory(cfg: PlanConfig, device: jax.Device) -> tuple[float, str]:
    """(bytes of one device, where the figure comes from)."""
    if cfg.device_memory_gb:
        return cfg.device_memory_gb * GIB, "plan.device_memory_gb"
    if cfg.target:  # compile-only devices have no memory to ask
        gpu, fraction = targets.gpu(cfg.target), targets.memory_fraction()
        return gpu.memory_bytes * fraction, (
            f"{gpu.description}, {gpu.memory_bytes / GIB:.1f} GiB x {fraction:g} "
            f"(XLA_PYTHON_CLIENT_MEM_FRACTION)")
    return layout.device_bytes(device)


def _on_gpu(compiled: list[Any], mesh: Any) -> list[Any]:
    """The programs, when compiled for GPUs (their kernels are listed in the table)."""
    return compiled if mesh.devices.flat[0].platform == "gpu" else []


def _memory(compiled: Any) -> tuple[float, float, float]:
    """(arguments, temporaries, outputs not aliased to donated arguments) of a program."""
    m = compiled.memory_analysis()
    outputs = max(m.output_size_in_bytes - m.alias_size_in_bytes, 0)
    return float(m.argument_size_in_bytes), float(m.temp_size_in_bytes), float(outputs)


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
    args, temp, outputs = _memory(compiled)
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
    return ProgramPlan("train step", parts, compile_s, limit,
                       gpu_programs=_on_gpu([compiled], place.mesh),
                       analysis={"arguments": args, "temp": temp, "outputs": outputs})


def plan_rollout(engine: Engine, rows: int, width: int, group: int, resident: float,
                 limit: float) -> ProgramPlan:
    """Compiles the rollout engine's programs for a round of `rows` requests per process
    (prompts of `width` tokens, runs of `group` identical ones) at their largest shapes,
    which the run then uses, and splits their memory: the parameters in the sampling
    layout, the paged KV cache (sized for the round's requests at full length) and the
    larger program's other scratch."""
    t0 = time.perf_counter()
    programs, kv = engine.compile_round(rows, width, group)
    compile_s = time.perf_counter() - t0
    memory = [_memory(c) for c in programs]
    args, temp, outputs = max(memory, key=lambda m: m[1])
    params = held_bytes(engine.abstract_params)
    parts = {"parameters": params, "KV cache": kv,
             "activations / scratch": max(temp + outputs - kv, 0.0),
             "inputs": max(args - params - kv, 0.0), "resident": resident}
    notes = ["resident: the train state beside the sampling program (colocated)"] if resident else []
    pool = engine.round_pool(rows, width)
    return ProgramPlan("rollout", parts, compile_s, limit, notes=notes,
                       gpu_programs=_on_gpu(programs, engine.mesh),
                       analysis={"arguments": args, "temp": temp, "outputs": outputs},
                       kv_tokens=pool.shape[2] * pool.shape[3], kv_block=pool.shape[3],
                       request_tokens=width + engine.cfg.max_new_tokens)


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
             if auto and _splits_rows(cfg) else [])
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
    if tried:
        mesh = built[0].mesh
        train.chosen.insert(0, (
            f"mesh.context=auto -> {mesh.context_width} with mesh.fsdp={mesh.fsdp} mesh.data="
            f"{mesh.data} (the train step at the narrowest budget did not fit at width "
            f"{', '.join(tried)} GiB per device)"))
    return *built, memory_plan(*built, train)


def _splits_rows(cfg: Config) -> bool:
    """Whether the context axis applies: SFT's rows, RL's and pairs' with train.packed."""
    return cfg.train.packed or registry.get(cfg.algo.name).family is Family.SFT


def _train_plan(cfg: Config, setup: Setup, stepper: Stepper) -> ProgramPlan:
    """The train step's plan; train.micro_batch_tokens=0: at the budget that fits
    (`_fit_budget`)."""
    limit = _limit(cfg, setup)[0]

    def train_plan() -> ProgramPlan:
        return plan_train_step(setup.step_fn, setup.place, stepper.batch_spec(), cfg.optim.freeze,
                               stepper.resident_bytes(), limit, setup.teacher)

    train = train_plan()
    if cfg.train.packed and hasattr(stepper, "budget"):
        if cfg.train.micro_batch_tokens == 0:
            train = _fit_budget(stepper, train, train_plan)
        train.micro_rows = stepper.batch_spec()["pack/tokens"].shape[0] // stepper.shards
    return train


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
    rollout = stepper.rollout_plan(limit)
    if rollout is not None and cfg.rollout.kv_cache_tokens == 0:
        rollout = _fit_pool(stepper, rollout, limit)
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


def _fit_pool(stepper: Stepper, plan: ProgramPlan, limit: float) -> ProgramPlan:
    """rollout.kv_cache_tokens=0 (auto): the pool for every slot's longest request, or,
    when it does not fit beside the rest, the largest cap that does (`_kv_cap`; the
    scheduler queues the requests the pool cannot hold), said in the plan's `chosen`."""
    if plan.fits or plan.largest()[0] != "KV cache" or not plan.kv_tokens:
        return plan
    cap = _kv_cap(plan, plan.limit - (plan.total - plan.parts["KV cache"]))
    if cap < plan.request_tokens:
        return plan  # not one request: the advice says what else to change
    engine = stepper.engine
    engine.cfg = dataclasses.replace(engine.cfg, kv_cache_tokens=cap)
    new = stepper.rollout_plan(limit)
    new.chosen.append(f"rollout.kv_cache_tokens=0 (auto) -> {cap:,} tokens per rollout data "
                      f"shard ({cap // plan.request_tokens} of the longest requests at once; "
                      f"the pool for every slot, {plan.parts['KV cache'] / GIB:.1f} GiB per "
                      f"device, did not fit)")
    return new


def plan_summary(plans: list[ProgramPlan]) -> str:
    """The start-up line's part: each program's total of the device's memory."""
    return ", ".join(f"{p.name} {p.total / GIB:.2f} GiB" for p in plans) + (
        f" of {plans[0].limit / GIB:.1f} GiB")


def _kv_cap(plan: ProgramPlan, room: float) -> int:
    """The largest `rollout.kv_cache_tokens` whose pool (its blocks rounded up to three
    significant bits, plus block 0: `gpurl.rollout.blocks.pool_blocks`) takes at most 95%
    of `room` bytes per device, from the planned pool's bytes per token."""
    per_token = plan.parts["KV cache"] / plan.kv_tokens
    blocks = int(0.95 * room / per_token) // plan.kv_block
    while blocks > 1 and three_bits(blocks) != blocks:
        blocks -= 1
    return (blocks - 1) * plan.kv_block


def advice(cfg: Config, plan: ProgramPlan) -> str:
    """One sentence: what does not fit, its largest part, and the fixes, cheapest first
    (remat, micro-batch, token budget, context width, fsdp, LoRA, shorter completions)."""
    part, size = plan.largest()
    fixes = []
    micro = cfg.train.batch_size // cfg.train.num_micro_batches
    if plan.name == "train step" and remat_policy(cfg.model) != "full":
        fixes.append("model.remat=full")
    smaller = [d for d in range(plan.batch_shards, micro, plan.batch_shards) if micro % d == 0]
    if plan.name == "train step" and smaller:
        fixes.append(f"train.micro_batch_size={smaller[-1]}")
    if plan.name == "train step" and _splits_rows(cfg) and part == "activations / scratch":
        if plan.micro_rows > 1:  # one row per micro-batch and batch shard
            fixes.append("train.micro_batch_tokens=1")
        wider = plan.context * 2  # each row over more devices (data or fsdp narrower)
        if wider <= min(plan.devices, 32):
            fixes.append(f"mesh.context={wider}")
    if part == "KV cache" and plan.kv_tokens:  # fewer rows decoding at once
        cap = _kv_cap(plan, plan.limit - (plan.total - size))
        if cap >= plan.request_tokens:
            fixes.append(f"rollout.kv_cache_tokens={cap}")
    if plan.fsdp * plan.context < plan.devices:  # parameters split over fsdp and context
        fixes.append("mesh.data=1 mesh.fsdp=-1")
    if not cfg.model.lora.rank:
        fixes.append("model.lora.rank=16")
    if registry.get(cfg.algo.name).family is Family.RL and cfg.rollout.max_new_tokens > 1:
        fixes.append(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens // 2}")
    fixes = ", ".join(fixes) if fixes else "more devices or a smaller model"
    return (f"the {plan.name} needs {plan.total / GIB:.1f} GiB per device but a device has "
            f"{plan.limit / GIB:.1f} GiB (largest part: {part}, {size / GIB:.1f} GiB); try, "
            f"cheapest first: {fixes} (`gpurl plan` with the same overrides prints every "
            f"part; plan.device_memory_gb sets the limit, plan.check=false skips the check).")


def check(cfg: Config, plans: list[ProgramPlan]) -> None:
    """Raises one sentence for the first program that does not fit, on every process when
    one process's does not (they would otherwise wait for each other)."""
    if not plans:
        return
    bad = next((p for p in plans if not p.fits), None)
    if host.any_process(bad is not None):
        worst = bad or max(plans, key=lambda p: p.total / p.limit)
        raise ConfigError(advice(cfg, worst))

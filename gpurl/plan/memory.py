"""The memory plan of a run's programs: each compiled ahead of time for the mesh the run
uses, from abstract arrays, with XLA's memory analysis split into the parts a user can act
on and checked against a device's memory; the kernels a GPU program runs; and the one
sentence of advice when a program does not fit.

`gpurl.train.fitting` builds the run with the trainer's own builders and hands this module
the compiled programs (`ProgramRecord`s, a `RolloutRound`); `gpurl plan` prints the tables.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import jax

from gpurl.algorithms import registry
from gpurl.algorithms.registry import Family
from gpurl.buckets import three_bits
from gpurl.config import Config, ConfigError, PlanConfig
from gpurl.distributed import host, layout
from gpurl.distributed.mesh import held_bytes
from gpurl.models.transformer import remat_policy
from gpurl.plan import targets
from gpurl.plan.programs import Kind, RolloutRound

GIB = 2**30
PARTS = ("parameters", "optimizer state", "gradients", "activations / scratch", "KV cache",
         "KV cache (evaluation)", "teacher", "inputs", "resident")


# Custom calls of a GPU program that name the kernel a user chose (or `auto` chose)
GPU_KERNELS = {"__cudnn$fmha": "cuDNN flash attention", "__gpu$xla.gpu.triton": "Pallas (Triton)",
               "__cublas$gemm": "cuBLAS matmul"}
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def kernel_note(compiled: Any) -> str:
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

    kind: Kind  # Kind.TRAIN or Kind.ROLLOUT (its prefill and decode chunk)
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
    # compiled for a GPU, by kind (Kind.TRAIN; Kind.PREFILL and Kind.DECODE); empty on a CPU
    gpu_programs: dict[Kind, Any] = field(default_factory=dict, repr=False)
    account: list[str] = field(default_factory=list)  # the GPU compiler's (`efficiency`)

    @property
    def name(self) -> str:
        return self.kind.value

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
                 + ([kernel_note(self.gpu_programs.values())] if self.gpu_programs else []))
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


def on_gpu(compiled: dict[Kind, Any], mesh: Any) -> dict[Kind, Any]:
    """The programs, when compiled for GPUs (their kernels are listed in the table)."""
    return compiled if mesh.devices.flat[0].platform == "gpu" else {}


def memory_of(compiled: Any) -> tuple[float, float, float]:
    """(arguments, temporaries, outputs not aliased to donated arguments) of a program."""
    m = compiled.memory_analysis()
    outputs = max(m.output_size_in_bytes - m.alias_size_in_bytes, 0)
    return float(m.argument_size_in_bytes), float(m.temp_size_in_bytes), float(outputs)


def plan_rollout(round_: RolloutRound, limit: float) -> ProgramPlan:
    """Compiles the rollout engine's programs for a round (`RolloutRound`: requests per
    process, prompt width, runs of identical prompts; a stream's batches in flight) at
    their largest shapes, which the run then uses, and splits their memory: the parameters
    in the sampling layout, the paged KV cache (sized for the round's requests at full
    length; an evaluation's pool beside a stream's), the larger program's other scratch
    and what stays resident beside it."""
    engine, width = round_.engine, round_.width
    rows = round_.rows * round_.in_flight
    t0 = time.perf_counter()
    programs, kv = engine.compile_round(rows, width, round_.group)
    compile_s = time.perf_counter() - t0
    memory = [memory_of(c) for c in programs]
    args, temp, outputs = max(memory, key=lambda m: m[1])
    params = held_bytes(engine.abstract_params)
    parts = {"parameters": params, "KV cache": kv,
             "activations / scratch": max(temp + outputs - kv, 0.0),
             "inputs": max(args - params - kv, 0.0), "resident": round_.resident}
    notes = (["resident: the train state beside the sampling program (colocated)"]
             if round_.resident else [])
    if round_.eval_rows:
        parts["KV cache (evaluation)"] = engine.pool_bytes(round_.eval_rows, width)
        notes.append("KV cache (evaluation): an evaluation's pool beside the continuous "
                     "stream's")
    pool = engine.round_pool(rows, width)
    return ProgramPlan(Kind.ROLLOUT, parts, compile_s, limit, notes=notes + round_.notes,
                       gpu_programs=on_gpu(dict(zip((Kind.PREFILL, Kind.DECODE), programs)),
                                           engine.mesh),
                       analysis={"arguments": args, "temp": temp, "outputs": outputs},
                       kv_tokens=pool.shape[2] * pool.shape[3], kv_block=pool.shape[3],
                       request_tokens=width + engine.cfg.max_new_tokens)


def splits_rows(cfg: Config) -> bool:
    """Whether the context axis applies: SFT's rows, RL's and pairs' with train.packed."""
    return cfg.train.packed or registry.get(cfg.algo.name).family is Family.SFT


def plan_summary(plans: list[ProgramPlan]) -> str:
    """The start-up line's part: each program's total of the device's memory."""
    return ", ".join(f"{p.name} {p.total / GIB:.2f} GiB" for p in plans) + (
        f" of {plans[0].limit / GIB:.1f} GiB")


def kv_cap(plan: ProgramPlan, room: float) -> int:
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
    if plan.kind is Kind.TRAIN and remat_policy(cfg.model) != "full":
        fixes.append("model.remat=full")
    smaller = [d for d in range(plan.batch_shards, micro, plan.batch_shards) if micro % d == 0]
    if plan.kind is Kind.TRAIN and smaller:
        fixes.append(f"train.micro_batch_size={smaller[-1]}")
    if plan.kind is Kind.TRAIN and splits_rows(cfg) and part == "activations / scratch":
        if plan.micro_rows > 1:  # one row per micro-batch and batch shard
            fixes.append("train.micro_batch_tokens=1")
        wider = plan.context * 2  # each row over more devices (data or fsdp narrower)
        if wider <= min(plan.devices, 32):
            fixes.append(f"mesh.context={wider}")
    if part == "KV cache" and plan.kv_tokens:  # fewer rows decoding at once
        cap = kv_cap(plan, plan.limit - (plan.total - size))
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

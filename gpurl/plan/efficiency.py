"""What the GPU compiler says of a run: each GPU program's flops and HBM bytes per unit of
work, by the compiler's own account of its optimized module (`gpurl.plan.account`),
beside the ideal and the roofline time on the targeted GPU (`targets.GPUS`: its dense bf16
peak and its memory bandwidth), and from them a bound on decode tokens/s and on an RL
step's tokens/s per GPU. `gpurl plan plan.target=...` prints it under each program; tests
and benchmarks call `accounts` (its `RLBound`), and `gpurl plan plan.json=FILE` writes
them as JSON.

Units and ideals, per device:
- decode step (the decode chunk's loop body: every row one token): the rollout's weights
  read once in their dtype plus the live KV cache of every row at the round's full context
  (`rollout.max_new_tokens` after the prompt; a sliding-window layer reads its window);
- prefill (one call: the round's prompts): the weights once plus the keys and values it
  writes; flops 2 x matmul parameters x tokens + causal attention;
- train step (one call: a micro-batch at the plan's shape): 6 x matmul parameters x tokens
  (4 x with LoRA: frozen weights get no gradient), + 2 x under full remat, + attention
  (forward 4 x heads x head_dim x causal pairs, 3x with its backward, 4x under remat); the
  vocabulary head on the slots that predict a token;
- prepare (RL: the log-probs of the reference and old policy, the reward model): reported,
  no ideal.
Matmul parameters: the layers' weights (a mixture-of-experts layer's experts times k / E),
not the embedding lookup. These are the compiler's numbers on a GPU it does not have
(no autotuning, no measurement): a bound, never a timing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpurl.algorithms import registry
from gpurl.algorithms.registry import Family
from gpurl.config import Config
from gpurl.distributed.mesh import held_bytes
from gpurl.models.transformer import STACKS, compute_dtype, remat_policy
from gpurl.plan.account import Account, Cost, Hints
from gpurl.plan.programs import Kind
from gpurl.plan.targets import Gpu

GB = 1e9


@dataclass
class ProgramAccount:
    """One program's account per unit of work, per device."""

    name: str
    unit: str
    cost: Cost
    ideal_flops: float = 0.0
    ideal_bytes: float = 0.0
    ideal: str = ""  # what the ideal counts
    tokens: float = 0.0  # tokens a unit processes per device (decode: rows)
    notes: list[str] = field(default_factory=list)
    model_flops: float = 0.0  # train: the ideal without remat's recompute (MFU counts these)
    kv_bytes: float = 0.0  # decode: the ideal's live KV cache, read at the unit's full context

    def seconds(self, gpu: Gpu) -> float:
        """Roofline time: the larger of flops at the peak and bytes at the bandwidth."""
        return max(self.cost.flops / gpu.bf16_flops, self.cost.bytes / gpu.bandwidth)

    def bound_by(self, gpu: Gpu) -> str:
        return ("compute" if self.cost.flops / gpu.bf16_flops >= self.cost.bytes / gpu.bandwidth
                else "bandwidth")

    @property
    def bytes_ratio(self) -> float | None:
        return self.cost.bytes / self.ideal_bytes if self.ideal_bytes else None

    @property
    def flops_ratio(self) -> float | None:
        return self.cost.flops / self.ideal_flops if self.ideal_flops else None

    def record(self, gpu: Gpu) -> dict[str, Any]:
        """The account as JSON values (`gpurl plan plan.json=...`): per unit, per device."""
        return {"program": self.name, "unit": self.unit, "flops": self.cost.flops,
                "bytes": self.cost.bytes, "ideal_flops": self.ideal_flops,
                "ideal_bytes": self.ideal_bytes, "ideal": self.ideal, "tokens": self.tokens,
                "model_flops": self.model_flops, "kv_bytes": self.kv_bytes,
                "roofline_s": self.seconds(gpu), "bound": self.bound_by(gpu)}

    def lines(self, gpu: Gpu) -> list[str]:
        ratios = []
        if self.flops_ratio is not None:
            ratios.append(f"flops {self.flops_ratio:.2f}x")
        if self.bytes_ratio is not None:
            ratios.append(f"bytes {self.bytes_ratio:.2f}x")
        t = self.seconds(gpu)
        parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in
                          sorted(self.cost.by_kind.items(), key=lambda kv: -kv[1]) if v >= 0.005 * GB)
        out = [f"compiler's account, {self.name} per {self.unit}: {self.cost.flops / 1e12:.3f} "
               f"TFLOP, {self.cost.bytes / GB:.2f} GB of HBM ({parts})"]
        if ratios:
            amounts = [f"{self.ideal_flops / 1e12:.3f} TFLOP"] + (
                [f"{self.ideal_bytes / GB:.2f} GB"] if self.ideal_bytes else [])
            out.append(f"  ideal ({self.ideal}): {', '.join(amounts)} -> {', '.join(ratios)} "
                       f"the ideal")
        rate = f"; <= {self.tokens / t:,.0f} tokens/s per GPU" if self.tokens and t else ""
        out.append(f"  roofline on {gpu.description}: {t * 1e3:.3f} ms ({self.bound_by(gpu)}-"
                   f"bound){rate}")
        if self.cost.link and gpu.link_bandwidth:
            link_s = self.cost.link / gpu.link_bandwidth
            out.append(f"  interconnect: {self.cost.link / GB:.2f} GB per device by collectives "
                       f"-> {link_s * 1e3:.3f} ms at NVLink's {gpu.link_bandwidth / GB:.0f} GB/s "
                       f"({link_s / t:.2f}x the roofline time, hidden only where it overlaps)")
            if self.cost.expert_link:
                expert_s = self.cost.expert_link / gpu.link_bandwidth
                out.append(f"  expert parallelism: {self.cost.expert_link / GB:.2f} GB per device "
                           f"by the experts' token dispatch and combine -> {expert_s * 1e3:.3f} ms "
                           f"({expert_s / t:.2f}x the roofline time)")
        return out + [f"  {n}" for n in self.notes]


# ------------------------------------------------------------------ model figures


def matmul_params(abstract: Any, cfg: Any) -> float:
    """Weights a token runs through in the layers' matmuls: every stacked leaf but norm
    scales, a sparse layer's experts times k / E (any tree: a policy with its critic)."""
    total = 0.0
    share = (cfg.moe.experts_per_token / cfg.moe.num_experts) if cfg.moe.num_experts else 1.0

    def walk(tree: Any, in_stack: bool, in_moe: bool) -> None:
        nonlocal total
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, in_stack or key in STACKS, in_moe or key == "moe")
            elif in_stack and key != "scale":  # norm scales multiply, they do not matmul
                experts = in_moe and key in ("gate", "up", "down")
                total += math.prod(value.shape) * (share if experts else 1.0)
    walk(abstract, False, False)
    return total


def _window_tokens(cfg: Any, context: int) -> float:
    """Tokens a query at position `context` reads per layer, averaged over the layers."""
    window = cfg.sliding_window or context
    return sum(context if cfg.is_global(i) else min(context, window)
               for i in range(cfg.num_layers)) / cfg.num_layers


def _causal_pairs(cfg: Any, length: int, before: int = 0) -> float:
    """Query-key pairs of `length` causal tokens after `before` visible ones, summed over
    the layers (a sliding-window layer sees its window)."""
    total = 0.0
    for i in range(cfg.num_layers):
        t = np.arange(before + 1, before + length + 1, dtype=np.float64)
        total += float(np.sum(t if cfg.is_global(i) else np.minimum(t, cfg.sliding_window)))
    return total


def _heads(cfg: Any, tp: int) -> tuple[float, float]:
    """(query heads, key-value heads) per device under a tensor-parallel width `tp`."""
    kv = cfg.num_kv_heads / tp if cfg.num_kv_heads % tp == 0 else cfg.num_kv_heads
    return cfg.num_heads / tp, kv


# ------------------------------------------------------------------ the programs


def decode_account(engine: Any, compiled: Any, rows: int, width: int, group: int) -> ProgramAccount:
    """The decode chunk's decode step at the round's full context (`width` prompt tokens
    + rollout.max_new_tokens)."""
    cfg, tp = engine.spec.cfg, engine.mesh.shape["tp"]
    _, _, per_shard = engine.round_rows(rows, group)
    context = width + engine.cfg.max_new_tokens
    tokens = _window_tokens(cfg, context)
    hints = Hints(kv_tokens=tokens, group=cfg.num_heads // cfg.num_kv_heads)
    account = Account(compiled.as_text(), hints)
    cost = account.step()
    heads, kv_heads = _heads(cfg, tp)
    itemsize = np.dtype(compute_dtype(cfg)).itemsize
    kv = per_shard * tokens * cfg.num_layers * kv_heads * cfg.head_dim * 2 * itemsize
    weights = held_bytes(engine.abstract_params)
    mm = matmul_params(engine.spec.abstract_params, cfg) / tp + cfg.vocab_size * cfg.d_model / tp
    flops = 2 * mm * per_shard + 4 * per_shard * heads * cfg.head_dim * tokens * cfg.num_layers
    f32, converted = account.float32_weights(), account.converted_weights()
    notes = [f"weights read in float32: {', '.join(f32[:3]) or 'none'}; weights converted "
             f"inside the decode loop: {', '.join(converted[:3]) or 'none'}"]
    return ProgramAccount(
        "rollout decode chunk", f"decode step ({per_shard} rows, {context:,}-token context)",
        cost, flops, weights + kv,
        f"weights {weights / GB:.2f} GB once + live KV {kv / GB:.2f} GB", per_shard, notes,
        kv_bytes=kv)


def prefill_account(engine: Any, compiled: Any, rows: int, width: int, group: int) -> ProgramAccount:
    """One prefill of the round's prompts (`width` tokens each, padded)."""
    cfg, tp = engine.spec.cfg, engine.mesh.shape["tp"]
    prompts, admitted, _ = engine.round_rows(rows, group)
    cost = Account(compiled.as_text()).program()
    heads, kv_heads = _heads(cfg, tp)
    itemsize = np.dtype(compute_dtype(cfg)).itemsize
    tokens = prompts * width
    written = tokens * cfg.num_layers * kv_heads * cfg.head_dim * 2 * itemsize
    weights = held_bytes(engine.abstract_params)
    mm = matmul_params(engine.spec.abstract_params, cfg) / tp
    flops = (2 * mm * tokens + 2 * cfg.vocab_size * cfg.d_model / tp * admitted
             + 4 * heads * cfg.head_dim * prompts * _causal_pairs(cfg, width))
    return ProgramAccount(
        "rollout prefill", f"prefill ({prompts} prompts x {width} tokens, {admitted} rows)",
        cost, flops, weights + written,
        f"weights {weights / GB:.2f} GB once + the prompts' KV {written / GB:.2f} GB", tokens)


def train_account(name: str, compiled: Any, spec: Any, batch: dict[str, Any], devices: int,
                  remat: str, lora: bool) -> ProgramAccount:
    """One call of the train step at the plan's batch shapes."""
    cfg = spec.policy.cfg
    context = batch["pack/head"].shape[1] if "pack/head" in batch else 1
    cost = Account(compiled.as_text(), Hints(context=context)).program()
    tokens, head, pairs = _train_tokens(cfg, batch)
    mm = matmul_params(spec.abstract_params, cfg)
    layers_fwd = 2 * mm * tokens + 4 * cfg.num_heads * cfg.head_dim * pairs
    head_fwd = 2 * cfg.vocab_size * cfg.d_model * head
    passes = 2 if lora else 3  # forward, input gradients, weight gradients
    extra = 1 if remat == "full" else 0  # full remat runs each layer's forward again
    flops = ((passes + extra) * layers_fwd + passes * head_fwd) / devices
    return ProgramAccount(
        name, f"call ({tokens:,.0f} token slots, {head:,.0f} predicted)", cost, flops, 0.0,
        f"{2 * passes}NT{' + 2NT remat' if extra else ''} + attention", tokens / devices,
        model_flops=passes * (layers_fwd + head_fwd) / devices)


def _train_tokens(cfg: Any, batch: dict[str, Any]) -> tuple[float, float, float]:
    """(token slots, slots that predict a token, causal query-key pairs over the layers)
    of a train-step batch: packed rows, grouped prompts and completions, or rows."""
    if "pack/positions" in batch:
        rows, length = batch["pack/positions"].shape
        return rows * length, math.prod(batch["pack/head"].shape), rows * _causal_pairs(cfg, length)
    if "prompt_tokens" in batch and "completions" in batch:
        p, w = batch["prompt_tokens"].shape
        comp = batch["completions"].shape
        g, n = math.prod(comp[1:-1]), comp[-1]
        pairs = p * _causal_pairs(cfg, w) + p * g * _causal_pairs(cfg, n, w)
        return p * w + p * g * n, p * g * n, pairs
    rows, length = next(x.shape for x in batch.values() if len(x.shape) == 2)
    return rows * length, rows * length, rows * _causal_pairs(cfg, length)


@dataclass
class RLBound:
    """An RL step at the roofline: `waves` rounds of a prefill and `new_tokens` decode
    steps (every row to the longest completion; a step reads `decode_bytes`, the decode
    account's bytes with its live KV cache at the mean context of the round's steps), then
    each trainer program (`steps`: its account, calls per step); `sequences` of `length`
    tokens over `devices` GPUs."""

    prefill: ProgramAccount
    decode: ProgramAccount
    steps: list[tuple[ProgramAccount, float]]
    new_tokens: int
    waves: int
    sequences: int
    length: int
    devices: int
    decode_bytes: float

    def phases(self, gpu: Gpu) -> dict[str, float]:
        """Roofline seconds per step: the rollout, then each trainer program by name."""
        step = max(self.decode.cost.flops / gpu.bf16_flops, self.decode_bytes / gpu.bandwidth)
        out = {"rollout": self.waves * (self.prefill.seconds(gpu) + self.new_tokens * step)}
        for account, calls in self.steps:
            out[account.name] = out.get(account.name, 0.0) + account.seconds(gpu) * calls
        return out

    def rate(self, gpu: Gpu) -> float:
        """Tokens/s per GPU at the roofline."""
        return self.sequences * self.length / sum(self.phases(gpu).values()) / self.devices

    def line(self, gpu: Gpu) -> str:
        phases = self.phases(gpu)
        train = sum(v for k, v in phases.items() if k != "rollout")
        return (f"compiler's bound on the RL step: {self.rate(gpu):,.0f} tokens/s per GPU "
                f"({self.sequences} sequences x {self.length} tokens; rollout "
                f"{phases['rollout']:.2f} s + trainer {train:.2f} s at the roofline, every row "
                f"decoding {self.new_tokens} tokens, each step at its own context)")

    def record(self, gpu: Gpu) -> dict[str, Any]:
        """The bound as JSON values: each phase's roofline seconds, what they count, and
        each program's account (per unit, per device)."""
        return {"tokens_per_s_per_gpu": self.rate(gpu), "phases_s": self.phases(gpu),
                "sequences": self.sequences, "length": self.length, "devices": self.devices,
                "new_tokens": self.new_tokens, "waves": self.waves,
                "decode_bytes": self.decode_bytes,
                "calls": {a.name: calls for a, calls in self.steps},
                "programs": [a.record(gpu) for a in
                             (self.prefill, self.decode, *(a for a, _ in self.steps))]}


# ------------------------------------------------------------------ a run's programs


def accounts(cfg: Config, setup: Any, stepper: Any, plans: list[Any],
             gpu: Gpu) -> RLBound | None:
    """The account of every GPU program the plan compiled (and the RL prepare step,
    compiled here), as lines under each plan's table; returns the RL step's bound (None
    without a rollout). Programs are found by `Kind`."""
    by_kind = {p.kind: p for p in plans}
    train_plan = by_kind[Kind.TRAIN]
    lora = cfg.model.lora.rank > 0
    remat = remat_policy(cfg.model)
    devices = setup.place.mesh.size
    batch = stepper.batch_spec()
    train = train_account(Kind.TRAIN.value, train_plan.gpu_programs[Kind.TRAIN], setup.spec,
                          batch, devices, remat, lora)
    train_plan.account = train.lines(gpu)
    round_ = stepper.rollout_round()
    rollout_plan = by_kind.get(Kind.ROLLOUT)
    if round_ is None or rollout_plan is None:
        return None
    engine, rows, width, group = round_.engine, round_.rows, round_.width, round_.group
    prefill = prefill_account(engine, rollout_plan.gpu_programs[Kind.PREFILL], rows, width, group)
    decode = decode_account(engine, rollout_plan.gpu_programs[Kind.DECODE], rows, width, group)
    rollout_plan.account = prefill.lines(gpu) + decode.lines(gpu)
    steps = []
    for record in stepper.programs():
        if record.kind is Kind.PREPARE:
            hints = Hints(context=setup.place.mesh.shape.get("context", 1))
            prepare = ProgramAccount("prepare step", record.unit, Account(
                record.fn.lower(*record.args).compile().as_text(), hints).program())
            train_plan.account += prepare.lines(gpu)
            steps.append((prepare, 1.0))
    family = registry.get(cfg.algo.name).family
    sequences = cfg.train.batch_size * cfg.algo.num_generations
    length = width + engine.cfg.max_new_tokens
    passes = getattr(cfg.algo, "num_iterations", 1) if family is Family.RL else 1
    steps.append((train, passes * sequences * length / max(train.tokens * devices, 1.0)))
    waves = math.ceil(-(-rows // engine.local_shards) / engine.cfg.slots)
    new = engine.cfg.max_new_tokens
    # the live KV cache a step reads grows with its context: the mean over the round's steps
    full = _window_tokens(engine.spec.cfg, width + new)
    share = np.mean([_window_tokens(engine.spec.cfg, width + t) for t in range(1, new + 1)]) / full
    return RLBound(prefill, decode, steps, new, waves, sequences, length, devices,
                   decode.cost.bytes - decode.kv_bytes * (1.0 - share))

"""Train state and the jitted step: `(state, batch, teacher) -> (state, metrics)` (teacher:
a distillation algorithm's frozen `Teacher`, None otherwise).

Micro-batch gradient accumulation runs as a `lax.scan` inside the one jitted call; each
micro-batch takes rows strided across the batch so that every device works on every
micro-batch. Shardings are explicit on both sides and the old state is donated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gpurl.algorithms.objective import Batch, Objective, reduce_micro
from gpurl.config import ModelConfig, OptimConfig
from gpurl.data import packing
from gpurl.distributed.mesh import (Rules, batch_sharding, packed_spec, replicated, shard_bytes,
                                    tree_shardings)
from gpurl.models import lora, moe
from gpurl.models.paths import param_path
from gpurl.models.spec import ModelSpec, Params
from gpurl.models.transformer import compute_dtype
from gpurl.models.layers import sharded_rows
from gpurl.train.optim import trainable


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was NaN or infinite (train.on_nonfinite=stop); the
    message names the step and the checkpoint the run can resume from."""


@flax.struct.dataclass
class LossScale:
    """Dynamic loss scaling of an fp16 run, kept in the train state and its checkpoints."""

    scale: jax.Array  # float32 scalar: the loss is multiplied by it before the backward pass
    finite_steps: jax.Array  # int32 scalar: finite steps in a row since the scale last changed


@dataclass(frozen=True)
class Scaling:
    """How the scale moves (`optim.loss_scale_init`, `optim.loss_scale_growth_every`): an
    overflow (a non-finite gradient) skips the update and halves the scale; `growth_every`
    finite steps in a row double it. The values are PyTorch's GradScaler defaults
    (init 2^16, growth factor 2, backoff 0.5, growth interval 2000)."""

    init: float = 65536.0
    growth_every: int = 2000

    def start(self) -> LossScale:
        return LossScale(jnp.float32(self.init), jnp.zeros((), jnp.int32))

    def update(self, ls: LossScale, overflow: jax.Array) -> LossScale:
        grown = ls.finite_steps + 1 >= self.growth_every
        scale = jnp.where(overflow, ls.scale * 0.5, jnp.where(grown, ls.scale * 2.0, ls.scale))
        count = jnp.where(overflow | grown, 0, ls.finite_steps + 1)
        return LossScale(jnp.maximum(scale, 1.0).astype(jnp.float32), count.astype(jnp.int32))


def scaling_for(model: ModelConfig, optim: OptimConfig) -> Scaling | None:
    """The loss scaling of a run: fp16 compute (model.dtype=float16) has one, others none."""
    if compute_dtype(model) != jnp.float16:
        return None
    return Scaling(optim.loss_scale_init, optim.loss_scale_growth_every)


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Params
    opt_state: optax.OptState
    rng: jax.Array  # uint32[2] key data: advanced every step, saved in checkpoints
    loss_scale: LossScale | None = None  # fp16 runs only (None: no leaves, no checkpoint keys)


def init_state(spec: ModelSpec, optimizer: optax.GradientTransformation, seed: int,
               scaling: Scaling | None = None) -> TrainState:
    params = spec.init(seed)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params),
                      rng=jax.random.key_data(jax.random.key(seed + 1)),
                      loss_scale=None if scaling is None else scaling.start())


@dataclass(frozen=True)
class Placement:
    """Where the state and batches live on the trainer mesh."""

    mesh: Mesh
    state: Any  # TrainState of NamedShardings
    batch: NamedSharding
    abstract_state: Any  # TrainState of ShapeDtypeStructs
    # bools over the params: True for the frozen base of a LoRA run, which is never
    # trained or checkpointed (rebuilt from the model's checkpoint or seed); None = no LoRA
    frozen: Any = None
    rules: Rules | None = None  # how the parameters were placed (logical axis -> mesh axes)

    def state_bytes(self) -> float:
        """The train state (parameters, optimizer state) per device."""
        return (shard_bytes(self.abstract_state.params, self.state.params)
                + shard_bytes(self.abstract_state.opt_state, self.state.opt_state))


def checkpointed(place: Placement, tree: TrainState) -> TrainState:
    """The part of `tree` (a state, its shardings or its abstract form) that checkpoints
    hold: everything, or all but a LoRA run's frozen base (None leaves are left out)."""
    if place.frozen is None:
        return tree
    params = jax.tree.map(lambda x, f: None if f else x, tree.params, place.frozen)
    return tree.replace(params=params)


def complete(place: Placement, restored: TrainState, init: Callable[[], TrainState]) -> TrainState:
    """A restored `checkpointed` state with the frozen base put back from `init()`."""
    if place.frozen is None:
        return restored
    fresh = init()
    params = jax.tree.map(lambda r, f, frozen: f if frozen else r, restored.params,
                          fresh.params, place.frozen, is_leaf=lambda x: x is None)
    return restored.replace(params=params)


def placement(spec: ModelSpec, optimizer: optax.GradientTransformation, mesh: Mesh,
              rules: Rules, scaling: Scaling | None = None) -> Placement:
    """State shardings from `jax.eval_shape(init)`: optimizer moments follow their params."""
    abstract = jax.eval_shape(lambda: init_state(spec, optimizer, 0, scaling))
    param_sh = tree_shardings(abstract.params, spec.logical_axes, rules, mesh)
    by_path = {param_path(path): (sh, x.shape) for (path, sh), x in zip(
        jax.tree_util.tree_flatten_with_path(param_sh)[0], jax.tree.leaves(abstract.params))}

    def follow(path, leaf) -> NamedSharding:
        # Adam's mu/nu mirror the params (their paths end with a parameter's path) and take
        # its sharding; counters and anything else are replicated.
        keys = param_path(path).split("/")
        for start in range(len(keys)):
            sh, shape = by_path.get("/".join(keys[start:]), (None, None))
            if sh is not None and shape == leaf.shape:
                return sh
        return replicated(mesh)

    state_sh = TrainState(step=replicated(mesh), params=param_sh,
                          opt_state=jax.tree_util.tree_map_with_path(follow, abstract.opt_state),
                          rng=replicated(mesh),
                          loss_scale=jax.tree.map(lambda _: replicated(mesh), abstract.loss_scale))
    frozen = lora.frozen_base(abstract.params) if lora.has_adapters(abstract.params) else None
    return Placement(mesh, state_sh, batch_sharding(mesh, rules), abstract, frozen, rules)


def _split_micro(batch: Batch, num_micro: int, rows: NamedSharding) -> Batch:
    """B x ... -> M x B/M x ...; micro-batch m takes rows m, m+M, m+2M, ... so that
    every device holds B/M/devices rows of every micro-batch."""
    micro_rows = NamedSharding(rows.mesh, P(None, *rows.spec))

    def split(x):
        x = x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, micro_rows)
    return jax.tree.map(split, batch)


def accumulate_grads(spec: ModelSpec, objective: Objective, place: Placement, num_micro: int,
                     params: Params, batch: Batch, trainable: Any = None,
                     rng: jax.Array | None = None, loss_scale: jax.Array | None = None,
                     teacher: Any = None) -> tuple[Params, dict]:
    """Gradient of the global-batch loss, summed over micro-batches in a `lax.scan`.

    Each micro-batch's loss is its share of the global loss (normalizer computed once on
    the whole batch), so M micro-batches of B/M give the gradient of one batch of B.
    Parameters that `trainable` marks False are not differentiated (their gradient is 0):
    a frozen tied embedding then costs no vocabulary-sized gradient matmul. `rng` (a key)
    seeds LoRA dropout, a different mask in every micro-batch. With `loss_scale` (fp16)
    the loss is multiplied by it before the backward pass and the summed gradient divided
    by it in float32; the metrics keep the unscaled loss. `teacher` (a distillation
    algorithm's frozen model) reaches the loss as it is, never differentiated."""
    norm = objective.normalizer(batch)
    if trainable is None:
        trainable = jax.tree.map(lambda _: True, params)
    is_none = lambda x: x is None  # noqa: E731
    train_p = jax.tree.map(lambda p, t: p if t else None, params, trainable)
    frozen_p = jax.tree.map(lambda p, t: None if t else p, params, trainable)
    train_sh = jax.tree.map(lambda s, t: s if t else None, place.state.params, trainable)

    # the decoder's config: a language model's or reward model's own, PPO's policy's
    experts = (spec.cfg if hasattr(spec, "cfg") else spec.policy.cfg).moe

    def unscaled_loss(train_p, micro: Batch):
        full = jax.tree.map(lambda a, b: b if a is None else a, train_p, frozen_p, is_leaf=is_none)
        if not experts.num_experts:
            return objective.apply(spec, full, micro, norm, teacher)
        with moe.collect() as found:  # the router terms of the forward passes of this loss
            loss, metrics = objective.apply(spec, full, micro, norm, teacher)
        return moe.add_router_terms(loss, metrics, found, experts, 1.0 / num_micro)

    def loss_of_trainable(train_p, micro: Batch):
        loss, metrics = unscaled_loss(train_p, micro)
        return (loss if loss_scale is None else loss * loss_scale), metrics

    grad_fn = jax.value_and_grad(loss_of_trainable, has_aux=True)

    def body(grads_acc: Params, micro_and_key: tuple[Batch, jax.Array]) -> tuple[Params, dict]:
        micro, key = micro_and_key
        with lora.dropout_key(None if rng is None else key):
            (_, metrics), grads = grad_fn(train_p, micro)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
        return jax.lax.with_sharding_constraint(grads_acc, train_sh), metrics

    zeros = jax.tree.map(jnp.zeros_like, train_p)
    keys_M = jax.random.split(jax.random.key(0) if rng is None else rng, num_micro)
    if packing.is_packed(batch):
        # Packed rows: micro-batch m takes rows m, m+M, ... and reads the grouped arrays
        # whole, its own completions unmasked (`gpurl.data.packing.micro_batch`).
        rows_M, whole = packing.micro_batches(batch, num_micro)
        micro_rows = NamedSharding(place.batch.mesh, P(None, *packed_spec(place.batch)))
        rows_M = jax.lax.with_sharding_constraint(rows_M, jax.tree.map(lambda _: micro_rows, rows_M))
        micro_M = (rows_M, jnp.arange(num_micro))
        view = lambda micro: packing.micro_batch(micro[0], whole, micro[1], num_micro)  # noqa: E731
    else:
        micro_M, view = _split_micro(batch, num_micro, place.batch), lambda micro: micro
    grads, metrics_M = jax.lax.scan(lambda acc, xs: body(acc, (view(xs[0]), xs[1])), zeros,
                                    (micro_M, keys_M))
    grads = jax.tree.map(lambda g, p: jnp.zeros_like(p) if g is None else g, grads, params,
                         is_leaf=is_none)
    if loss_scale is not None:
        grads = jax.tree.map(lambda g: (g.astype(jnp.float32) / loss_scale).astype(g.dtype), grads)
    return grads, reduce_micro(metrics_M)


def jit_rows(fn: Callable, place: Placement, **jit_kwargs: Any) -> Any:
    """`jax.jit(fn)` whose model activations keep their rows sharded like the batch
    (`gpurl.models.layers.sharded_rows`): with FSDP, XLA then gathers the weights rather
    than the activations; mixture-of-experts layers run their experts where they live."""
    @functools.wraps(fn)
    def traced(*args: Any) -> Any:
        with sharded_rows(place.batch, place.rules):
            return fn(*args)

    return jax.jit(traced, **jit_kwargs)


class Program:
    """A jitted function that `compile` replaces by its ahead-of-time compilation for given
    abstract arguments (the memory plan's), which every later call then runs: the check
    costs no second compile."""

    def __init__(self, jitted: Any):
        self.jitted = self.fn = jitted

    def compile(self, *abstract_args: Any) -> Any:
        self.fn = self.jitted.lower(*abstract_args).compile()
        return self.fn

    def __call__(self, *args: Any) -> Any:
        if self.fn is not self.jitted:
            try:
                return self.fn(*args)
            except (TypeError, ValueError):
                # Arguments other than the planned ones (a compiled program checks them
                # before it runs, so nothing was consumed): jit, which caches per shape,
                # runs them, and the planned program stays for the planned arguments.
                pass
        return self.jitted(*args)


def make_train_step(spec: ModelSpec, objective: Objective, optimizer: optax.GradientTransformation,
                    place: Placement, num_micro: int, freeze: tuple[str, ...] = (),
                    skip_nonfinite: bool = False, scaling: Scaling | None = None,
                    teacher_shardings: Any = None) -> Program:
    """The jitted step `(state, batch, teacher, num_micro=None)`; `teacher_shardings` are
    those of a distillation algorithm's frozen `Teacher` (None: the step takes None).
    Its metrics hold `nonfinite` (1.0 when the loss or the gradient
    norm is NaN or infinite); with `skip_nonfinite` such an update is left out: parameters
    and optimizer state come back unchanged (the step counter and RNG still advance).
    With `scaling` (fp16; the state holds a `LossScale`) a non-finite gradient of a finite
    loss is an overflow: the update is left out, the scale halved (`Scaling`), and the
    step is not `nonfinite`; metrics `loss_scale` (the scale the step used) and `overflow`."""
    default_micro = num_micro

    def step(state: TrainState, batch: Batch, teacher: Any, num_micro: int | None = None
             ) -> tuple[TrainState, dict]:
        if num_micro is None:  # packed batches say theirs (`gpurl.data.packing.Plan`)
            num_micro = 1 if packing.is_packed(batch) else default_micro
        train = trainable(state.params, freeze)
        if place.frozen is not None:
            train = jax.tree.map(lambda t, f: t and not f, train, place.frozen)
        key, dropout_key = jax.random.split(jax.random.wrap_key_data(state.rng))
        scale = None if state.loss_scale is None else state.loss_scale.scale
        grads, metrics = accumulate_grads(spec, objective, place, num_micro, state.params, batch,
                                          train, dropout_key, scale, teacher)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["update_norm"] = optax.tree.norm(updates)
        finite_loss = jnp.isfinite(metrics.get("loss", 0.0))
        finite = jnp.isfinite(metrics["grad_norm"]) & finite_loss
        loss_scale = state.loss_scale
        if scaling is not None and loss_scale is not None:
            overflow = finite_loss & ~finite
            metrics["loss_scale"] = loss_scale.scale
            metrics["overflow"] = overflow.astype(jnp.float32)
            loss_scale = scaling.update(loss_scale, overflow)
            metrics["nonfinite"] = 1.0 - finite_loss.astype(jnp.float32)
        else:
            metrics["nonfinite"] = 1.0 - finite.astype(jnp.float32)
        # Frozen parameters are passed through, not added to a zero update: with LoRA that
        # would touch every base weight each step.
        params = jax.tree.map(lambda p, u, t: (p + u).astype(p.dtype) if t else p,
                              state.params, updates, train)
        if skip_nonfinite or scaling is not None:
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            params = jax.tree.map(keep, params, state.params)
            opt_state = jax.tree.map(keep, opt_state, state.opt_state)
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                               rng=jax.random.key_data(key), loss_scale=loss_scale)
        return new_state, metrics

    return Program(jit_rows(step, place, in_shardings=(place.state, place.batch,
                                                     teacher_shardings),
                            out_shardings=(place.state, replicated(place.mesh)), donate_argnums=0,
                            static_argnums=3))


def make_eval_step(spec: ModelSpec, objective: Objective, place: Placement,
                   teacher_shardings: Any = None) -> Callable:
    """Additive eval metrics of one batch, `(params, batch, teacher)` (normalizer 1: the
    caller divides by the total); `teacher_shardings` as in `make_train_step`."""
    def step(params: Params, batch: Batch, teacher: Any) -> dict:
        _, metrics = objective.apply(spec, params, batch, jnp.float32(1.0), teacher)
        return metrics

    return jit_rows(step, place, in_shardings=(place.state.params, place.batch,
                                               teacher_shardings),
                    out_shardings=replicated(place.mesh))


def make_init(spec: ModelSpec, optimizer: optax.GradientTransformation, place: Placement,
              seed: int, load_params: Callable[[], Params | None] = lambda: None,
              scaling: Scaling | None = None) -> Callable[[], TrainState]:
    """Creates the state directly in its shards (never whole on one device): random
    parameters, or the ones `load_params` places (a checkpoint's), with a fresh optimizer."""
    def init() -> TrainState:
        params = load_params()
        if params is None:
            return jax.jit(lambda: init_state(spec, optimizer, seed, scaling),
                           out_shardings=place.state)()
        if place.frozen is not None and not lora.has_adapters(params):  # a base checkpoint
            params = lora.with_fresh_adapters(spec, params, place.state.params, seed)
        fresh = jax.jit(lambda p: TrainState(
            step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p),
            rng=jax.random.key_data(jax.random.key(seed + 1)),
            loss_scale=None if scaling is None else scaling.start()),
            in_shardings=(place.state.params,), out_shardings=place.state, donate_argnums=0)
        return fresh(params)

    return init

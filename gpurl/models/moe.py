"""Mixture-of-experts MLP (Qwen3-MoE, HF `Qwen3MoeSparseMoeBlock`) and its router terms.

A router (D x O) scores the O experts of every token; the token goes to its top-k
experts by softmax probability (renormalized over the k when `norm_topk_prob`), and its
output is the probability-weighted sum of those experts' SwiGLU MLPs. Experts run as a
grouped matmul over the token copies sorted by expert (`gpurl.kernels.grouped_matmul`),
never as a loop over experts.

Parallelism is explicit. Inside a program that says how its batch and weights are laid
out (`gpurl.models.layers.sharded_rows` with rules), the experts run in a `shard_map`
over the whole mesh: each device sorts only its own tokens; expert weights split over the
`expert` logical axis's mesh axes are served by the devices that hold them: when those
axes also split the batch (the trainer's `expert` axis), a device all-gathers the tokens
of its expert group (dispatch), computes its experts' share of every token and
reduce-scatters the sums back to the tokens' owners (combine); when they do not (the
rollout mesh's `tp`), the shares are summed. FSDP-split weight dimensions are gathered
and TP-split expert hidden dimensions summed, as a dense layer would.

Router terms (`router_terms`): the Switch Transformer load-balancing loss (Fedus et al.
2021, eq. 4-6, pooled over layers as transformers' `load_balancing_loss_func`), the
router z-loss (Zoph et al. 2022, ST-MoE, eq. 5) and the expert load per layer.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any, Iterator

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from gpurl.config import ConfigError, ModelConfig, MoEConfig
from gpurl.models.axes import logical_spec
from gpurl.kernels.grouped_matmul import (grouped_matmul, layout_matmul, resolve, smallest_tile,
                                         tile_layout)
from gpurl.models.layers import ACTIVATIONS, Layout, context_axis, layout, param

# the name scope of the token dispatch and combine, which the GPU compiler's account
# (`gpurl.plan.account`) counts as expert parallelism's interconnect traffic
EXPERT_DISPATCH = "expert_dispatch"

# logical axes of the expert weights (gate and up, down)
IN_AXES = ("expert", "embed", "expert_mlp")
OUT_AXES = ("expert", "expert_mlp", "embed")


@flax.struct.dataclass
class RouterStats:
    """What the router terms need of one layer's routing (sums over real tokens)."""

    counts_O: jax.Array  # top-k assignments per expert
    probs_O: jax.Array  # router probabilities summed per expert
    tokens: jax.Array  # real (non-padding) tokens
    z: jax.Array  # logsumexp(router logits)^2 summed
    replayed: jax.Array  # routing replay: expert slots of real tokens taken from the sampler
    flips: jax.Array  # ... of which this router's own top-k would have chosen another expert
    dropped: jax.Array = 0.0  # token copies past an expert-parallel device's capacity


class MoE(nnx.Module):
    """Router (D x O), and gate and up (O x D x F) and down (O x F x D) expert weights."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        moe, pd = cfg.moe, cfg.param_dtype
        d, o, f = cfg.d_model, moe.num_experts, moe.expert_mlp_dim
        self.router = param(rngs, (d, o), ("embed", "router"), cfg.init_std, pd)
        self.gate = param(rngs, (o, d, f), IN_AXES, cfg.init_std, pd)
        self.up = param(rngs, (o, d, f), IN_AXES, cfg.init_std, pd)
        self.down = param(rngs, (o, f, d), OUT_AXES, cfg.init_std, pd)
        self.top_k, self.norm_topk = moe.experts_per_token, moe.norm_topk_prob
        self.act = ACTIVATIONS[cfg.activation]
        self.matmul, self.capacity = moe.grouped_matmul, moe.capacity_factor

    def route(self, x_BxTxD: jax.Array, mask_BxT: jax.Array, routes: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, RouterStats]:
        """(experts B x T x k, their weights B x T x k, stats). The router runs in fp32.
        `routes` (routing replay) fixes the experts of tokens where it is >= 0; their
        weights still come from this router's probabilities (so it gets a gradient)."""
        logits_BxTxO = jnp.einsum("btd,dx->btx", x_BxTxD.astype(jnp.float32),
                                  self.router[...].astype(jnp.float32))
        probs_BxTxO = jax.nn.softmax(logits_BxTxO, axis=-1)
        top_weights, top_experts = jax.lax.top_k(probs_BxTxO, self.top_k)
        m_BxT = mask_BxT.astype(jnp.float32)
        replayed = flips = jnp.zeros((), jnp.float32)
        if routes is not None:
            given = (routes >= 0) & (m_BxT[..., None] > 0)
            # a replayed expert that is not among this router's own top-k
            own = (routes[..., :, None] != top_experts[..., None, :]).all(-1)
            replayed = given.sum().astype(jnp.float32)
            flips = (own & given).sum().astype(jnp.float32)
            top_experts = jnp.where(routes >= 0, routes.astype(jnp.int32), top_experts)
            top_weights = jnp.take_along_axis(probs_BxTxO, top_experts, axis=-1)
        if self.norm_topk:
            top_weights = top_weights / top_weights.sum(-1, keepdims=True)
        counts_O = jnp.zeros(probs_BxTxO.shape[-1], jnp.float32).at[top_experts.reshape(-1)].add(
            jnp.repeat(m_BxT.reshape(-1), self.top_k))
        lse_BxT = jax.nn.logsumexp(logits_BxTxO, axis=-1)
        stats = RouterStats(counts_O, jnp.einsum("btx,bt->x", probs_BxTxO, m_BxT), m_BxT.sum(),
                            (lse_BxT * lse_BxT * m_BxT).sum(), replayed, flips)
        return top_experts, top_weights.astype(x_BxTxD.dtype), stats

    def __call__(self, x_BxTxD: jax.Array, mask_BxT: jax.Array,
                 routes: jax.Array | None = None) -> tuple[jax.Array, RouterStats, jax.Array]:
        """(output B x T x D, router stats, the chosen experts B x T x k)."""
        top_experts, top_weights, stats = self.route(x_BxTxD, mask_BxT, routes)
        weights = (self.gate[...], self.up[...], self.down[...])
        run = _Experts(self.act, self.matmul, self.capacity)
        # padding goes to no expert: it costs no expert work and takes no capacity
        routed = jnp.where(mask_BxT[..., None], top_experts, -1)
        out, dropped = run.parallel(x_BxTxD, routed, top_weights, weights, layout())
        return out, stats.replace(dropped=dropped), top_experts


@flax.struct.dataclass
class _Experts:
    """The experts' computation: on this device's tokens, or over the mesh (`parallel`)."""

    act: Any = flax.struct.field(pytree_node=False)
    matmul: str = flax.struct.field(pytree_node=False)
    capacity: float = flax.struct.field(pytree_node=False)

    def local(self, x_flat: jax.Array, chosen: jax.Array, gates: jax.Array,
              gate: jax.Array, up: jax.Array, down: jax.Array, first: jax.Array | int,
              experts: int, capacity: float) -> tuple[jax.Array, jax.Array]:
        """(tokens x D fp32: the share of experts first .. first + O_local - 1 (the
        weights' leading dimension) of `experts` in the output of every token, copies
        dropped past `capacity` x this device's even share). `x_flat` is tokens x D,
        `chosen` and `gates` tokens x k: each token goes to k experts as k copies. Past the
        capacity, the copies of the highest local experts are dropped first (the buffer is
        per device, not per expert)."""
        n, k = chosen.shape
        count = gate.shape[0]
        local = chosen.reshape(-1) - first
        # copies for other devices' experts (and padding, -1) sort last and join no group
        key = jnp.where((local >= 0) & (local < count), local, count)
        order = jnp.argsort(key, stable=True)
        sizes_O = jnp.zeros(count, jnp.int32).at[key].add(1, mode="drop")
        rows = n * k
        if capacity and count < experts:  # this device's buffer: its share x the factor
            rows = min(rows, -(-int(math.ceil(capacity * n * k * count / experts)) // 8) * 8)
            order = order[:rows]
        kept = jnp.minimum(jnp.cumsum(sizes_O), rows)
        dropped = (sizes_O.sum() - kept[-1]).astype(jnp.float32)
        sizes_O = kept - jnp.concatenate([jnp.zeros(1, kept.dtype), kept[:-1]])
        token = order // k
        gate_weight = gates.reshape(-1)[order]
        dt = x_flat.dtype
        gate, up, down = (w.astype(dt) for w in (gate, up, down))
        if resolve(self.matmul) in ("tiled", "pallas"):
            # the copies go straight into the tiled layout, and stay there through the
            # three matmuls (no sorted copy of the tokens beside it)
            lay = tile_layout(rows, sizes_O, smallest_tile(self.matmul))
            copy = jnp.full(lay.tiles * lay.tile, -1, jnp.int32).at[lay.slot].set(
                jnp.arange(rows, dtype=jnp.int32), mode="drop")
            token = jnp.where(copy >= 0, token[copy], 0)
            gate_weight = jnp.where(copy >= 0, gate_weight[copy], 0)
            x_pad = jnp.where((copy >= 0)[:, None], x_flat[token], 0)
            # what a balanced routing lays out: every local expert n k / E rows
            balanced = count * -(-n * k // (experts * lay.tile)) * lay.tile
            mm = functools.partial(layout_matmul, layout=lay, implementation=self.matmul,
                                   balanced_rows=balanced)
            hidden = self.act(mm(x_pad, gate)) * mm(x_pad, up)
            out_copies = mm(hidden, down)
        else:
            copies = x_flat[token]
            hidden = (self.act(grouped_matmul(copies, gate, sizes_O, self.matmul))
                      * grouped_matmul(copies, up, sizes_O, self.matmul))
            out_copies = grouped_matmul(hidden, down, sizes_O, self.matmul)  # 0: other experts
        out_copies = out_copies.astype(jnp.float32) * gate_weight[:, None].astype(jnp.float32)
        return jnp.zeros((n, x_flat.shape[1]), jnp.float32).at[token].add(out_copies), dropped

    def parallel(self, x_BxTxD: jax.Array, top_experts: jax.Array, top_weights: jax.Array,
                 weights: tuple[jax.Array, jax.Array, jax.Array], where: Layout | None
                 ) -> tuple[jax.Array, jax.Array]:
        """(output B x T x D, token copies dropped over the capacity, all devices)."""
        b, t, d = x_BxTxD.shape
        experts = weights[0].shape[0]
        mesh = None if where is None or where.rules is None else where.rows.mesh
        row_axes = () if mesh is None else _names(where.rows.spec[0] if where.rows.spec else None)
        if mesh is None or mesh.size == 1 or b % math.prod(mesh.shape[a] for a in row_axes):
            # no layout, one device, or rows that do not split over the shards (XLA then
            # runs every token on every device)
            out, dropped = self.local(x_BxTxD.reshape(b * t, d), top_experts.reshape(b * t, -1),
                                      top_weights.reshape(b * t, -1), *weights, 0, experts, 0.0)
            return out.reshape(b, t, d).astype(x_BxTxD.dtype), dropped
        rules = where.rules
        in_spec, out_spec = (logical_spec(IN_AXES, weights[0].shape, rules, mesh),
                             logical_spec(OUT_AXES, weights[2].shape, rules, mesh))
        expert_axes, embed_axes, mlp_axes = (_names(s) for s in in_spec)
        down_mlp_axes, down_embed_axes = _names(out_spec[1]), _names(out_spec[2])
        if set(mlp_axes + down_mlp_axes) & set(row_axes) or down_mlp_axes != mlp_axes:
            raise ConfigError(
                f"the expert_mlp rule maps experts' hidden width to mesh axes {mlp_axes or down_mlp_axes} "
                f"that also split batch rows ({row_axes}) or differ between the expert weights; "
                f"map expert_mlp to tp (mesh.train_rules / mesh.sample_rules).")
        dispatch = tuple(a for a in expert_axes if a in row_axes)  # gather / scatter tokens
        summed = tuple(a for a in expert_axes if a not in row_axes) + mlp_axes
        # capacity bounds a dispatching device's buffer (training's expert axis); sampling's
        # experts split over tp see the tokens they already hold and never drop
        capacity = self.capacity if dispatch else 0.0

        context = context_axis()  # packed rows' tokens split over it: each device its own

        def body(x_BxTxD, top_experts, top_weights, gate, up, down):
            t = x_BxTxD.shape[1]
            if embed_axes:  # FSDP: the whole embedding dimension of this device's experts
                gate, up = (jax.lax.all_gather(w, embed_axes, axis=1, tiled=True) for w in (gate, up))
            if down_embed_axes:
                down = jax.lax.all_gather(down, down_embed_axes, axis=2, tiled=True)
            bl = x_BxTxD.shape[0]
            tokens = (x_BxTxD.reshape(bl * t, d), top_experts.reshape(bl * t, -1),
                      top_weights.reshape(bl * t, -1))
            if dispatch:
                with jax.named_scope(EXPERT_DISPATCH):
                    tokens = tuple(jax.lax.all_gather(a, dispatch, axis=0, tiled=True)
                                   for a in tokens)
            first = jax.lax.axis_index(expert_axes) * gate.shape[0] if expert_axes else 0
            out, dropped = self.local(*tokens, gate, up, down, first, experts, capacity)
            if summed:
                out = jax.lax.psum(out, summed)
            if dispatch:
                with jax.named_scope(EXPERT_DISPATCH):
                    out = jax.lax.psum_scatter(out, dispatch, scatter_dimension=0, tiled=True)
            # counted once: summed over the devices of other experts and other rows (the
            # devices splitting one expert's hidden width drop the same copies)
            split = expert_axes + row_axes + ((context,) if context else ())
            distinct = tuple(dict.fromkeys(split))
            if distinct:
                dropped = jax.lax.psum(dropped, distinct)
            return out.reshape(bl, t, d).astype(x_BxTxD.dtype), dropped

        rows = P(row_axes or None, context, None)
        # Pallas's interpreter cannot check which values vary over the mesh inside a kernel
        # (as with the attention kernels); the equality tests hold the gradients to the
        # checked jnp path
        return jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, in_spec, in_spec, out_spec),
                             out_specs=(rows, P()), check_vma=resolve(self.matmul) != "pallas")(
            x_BxTxD, top_experts, top_weights, *weights)


def _names(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


# ---------------------------------------------------------------------- router terms

# The train step collects the router stats of every forward pass it traces (`collect`);
# every other forward (sampling, evaluation, reference log-probs) records nothing.
_COLLECTED: contextvars.ContextVar[list | None] = contextvars.ContextVar("router_stats", default=None)


@contextlib.contextmanager
def collect() -> Iterator[list[RouterStats]]:
    """The router stats (leading axis: sparse layers) of the forward passes traced inside."""
    found: list[RouterStats] = []
    token = _COLLECTED.set(found)
    try:
        yield found
    finally:
        _COLLECTED.reset(token)


def record(stats: RouterStats) -> None:
    """Adds a forward pass's router stats to the innermost `collect` block, if any."""
    found = _COLLECTED.get()
    if found is not None:
        found.append(stats)


# The sampler records the experts each token was routed to (routing replay), the way
# `collect` gathers router stats: forward passes traced inside `chosen_experts` add their
# S x B x T x k expert ids (S: sparse layers).
_CHOSEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("chosen_experts", default=None)


@contextlib.contextmanager
def chosen_experts() -> Iterator[list[jax.Array]]:
    """The experts (sparse layers x B x T x k) of the forward passes traced inside."""
    found: list[jax.Array] = []
    token = _CHOSEN.set(found)
    try:
        yield found
    finally:
        _CHOSEN.reset(token)


def recording_experts() -> bool:
    """Whether a traced forward pass should output its chosen experts."""
    return _CHOSEN.get() is not None


def record_experts(experts: jax.Array) -> None:
    """Adds a forward pass's chosen experts to the innermost `chosen_experts` block."""
    found = _CHOSEN.get()
    if found is not None:
        found.append(experts)


def router_terms(found: list[RouterStats], num_experts: int, top_k: int) -> dict[str, jax.Array]:
    """aux_loss (load balancing: O * sum_e f_e P_e, f_e the fraction of token copies routed to
    expert e and P_e its mean router probability, pooled over layers and forward passes),
    z_loss (mean logsumexp(router logits)^2), load_max (the most loaded expert's tokens over
    the mean, worst layer: 1 is perfect balance, O / k means k experts take everything)
    and, under routing replay, replay_flips (the share of replayed expert slots where this
    router would have chosen otherwise: the mismatch replay removes), and dropped (the
    share of token copies over an expert-parallel device's capacity)."""
    tokens = sum(s.tokens.sum() for s in found)
    counts_O = sum(s.counts_O.sum(0) for s in found)
    probs_O = sum(s.probs_O.sum(0) for s in found)
    denom = jnp.maximum(tokens, 1.0)
    aux = num_experts * jnp.sum((counts_O / denom) * (probs_O / denom))
    z = sum(s.z.sum() for s in found) / denom
    load_LxO = jnp.concatenate([s.counts_O for s in found])
    mean_L = jnp.maximum(load_LxO.mean(-1), 1e-9)
    load_max = jnp.max(load_LxO.max(-1) / mean_L)
    replayed = sum(s.replayed.sum() for s in found)
    flips = sum(s.flips.sum() for s in found) / jnp.maximum(replayed, 1.0)
    dropped = sum(s.dropped.sum() for s in found) / jnp.maximum(counts_O.sum(), 1.0)
    return {"aux_loss": aux, "z_loss": z, "load_max": load_max, "replay_flips": flips,
            "dropped": dropped}


def add_router_terms(loss: jax.Array, metrics: dict, found: list[RouterStats], cfg: MoEConfig,
                     share: float) -> tuple[jax.Array, dict]:
    """`loss` plus the configured router losses of the forward passes in `found`, and their
    metrics (moe/aux_loss, moe/z_loss, moe/load_max), each scaled by `share`: the train
    step sums a micro-batch's losses and metrics over its micro-batches."""
    if not found:
        return loss, metrics
    terms = router_terms(found, cfg.num_experts, cfg.experts_per_token)
    if not cfg.replay_routing:
        del terms["replay_flips"]
    if not cfg.capacity_factor:
        del terms["dropped"]
    total = (cfg.aux_loss_coef or 0.0) * terms["aux_loss"] + cfg.z_loss_coef * terms["z_loss"]
    metrics = {**metrics, **{f"moe/{k}": v * share for k, v in terms.items()}}
    return loss + share * total, metrics

"""Flash attention written with Pallas for GPUs (Triton lowering), forward and backward.

FlashAttention-2 (Dao 2023, arXiv:2307.08691, Algorithms 1 and 2): each program holds one
block of queries of one head, walks the keys in blocks and keeps a running max `m`, a
running normalizer `l` and an unnormalized output (the online softmax), so the T x S
logits never exist in memory. The backward pass recomputes each logits block from the
saved log-sum-exp (lse) in two kernels: one owns a query block and accumulates dQ, one
owns a key block and accumulates dK and dV over the queries of every head in its group.

The mask is the one of `gpurl.kernels.attention.attention_mask`, evaluated per block from
positions and segment ids: key visible iff kv_pos <= q_pos, the query's segment or its
shared prefix (`gpurl.kernels.segments`), key segment != 0 and (with a window)
q_pos - kv_pos < window. A key block that no query of the block
can see (from the blocks' position ranges) is skipped, which gives causal and window
attention their ~2x and ~T/window savings without assuming positions equal indices.
Queries that see no key (padding) return zeros, like the reference.

Shapes as in `attention.py`. Blocks are powers of two and at least 16 (Triton's dot);
T, S and D are zero-padded up to them (padding tokens get segment 0, so they are masked).
`interpret=True` runs the same kernels through Pallas's interpreter on any backend (CI).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gpurl.kernels.segments import BRANCHES, visible_segments

# Logit of a masked key: finite, so that a block with no visible key gives exp(0) * 0
# instead of exp(-inf - -inf) = nan; the explicit zeroing of masked p does the rest.
_MASKED = -1e30
_BIG = 2**30  # beyond any position or segment


class Static(NamedTuple):
    """Compile-time settings of one kernel call (hashable for custom_vjp)."""

    scale: float
    softcap: float | None
    window: int | None
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    interpret: bool


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(n - 1, 0).bit_length())


def _logits_and_mask(q, k, qpos, qseg, kpos, kseg, st: Static):
    """Capped, scaled fp32 logits of one bq x bk block and its visibility mask."""
    s = plgpu.dot(q, k, trans_b=True, allow_tf32=False).astype(jnp.float32) * st.scale
    if st.softcap is not None:
        s = st.softcap * jnp.tanh(s / st.softcap)
    visible = (kpos[None, :] <= qpos[:, None]) & visible_segments(qseg[:, None], kseg[None, :])
    if st.window is not None:
        visible &= qpos[:, None] - kpos[None, :] < st.window
    return jnp.where(visible, s, _MASKED), visible


def _block_live(qpos, qseg, kpos, kseg, st: Static):
    """Whether any query of the block may see any key of the block (a cheap superset):
    by positions, and by segments, which packed rows lay out in increasing order (a key
    block entirely before the queries' first group prefix, or after their last segment,
    is another sequence's)."""
    q_max = jnp.max(jnp.where(qseg != 0, qpos, -_BIG))
    q_min = jnp.min(jnp.where(qseg != 0, qpos, _BIG))
    k_min = jnp.min(jnp.where(kseg != 0, kpos, _BIG))
    k_max = jnp.max(jnp.where(kseg != 0, kpos, -_BIG))
    live = k_min <= q_max
    qs_min = jnp.min(jnp.where(qseg != 0, qseg, _BIG))
    qs_max = jnp.max(jnp.where(qseg != 0, qseg, -_BIG))
    ks_min = jnp.min(jnp.where(kseg != 0, kseg, _BIG))
    ks_max = jnp.max(jnp.where(kseg != 0, kseg, -_BIG))
    live &= (ks_max >= qs_min - qs_min % BRANCHES) & (ks_min <= qs_max)
    if st.window is not None:
        live &= k_max > q_min - st.window
    return live


def _softcap_grad(s_capped, st: Static):
    # d/ds [c tanh(s / c)] = 1 - tanh^2 = 1 - (capped / c)^2. Masked entries hold
    # _MASKED (whose square overflows to inf), so callers zero them afterwards.
    if st.softcap is None:
        return 1.0
    return 1.0 - jnp.square(s_capped / st.softcap)


def _fwd_kernel(q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, o_ref, lse_ref,
                *, st: Static):
    q, qpos, qseg = q_ref[...], qpos_ref[...], qseg_ref[...]
    bq, d = q.shape

    def body(j, carry):
        def update(carry):
            acc, m, l = carry
            sl = pl.ds(j * st.block_k, st.block_k)
            s, visible = _logits_and_mask(q, k_ref[sl, :], qpos, qseg, kpos, kseg, st)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            v = v_ref[sl, :]
            acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=False)
            return acc, m_new, l * alpha + jnp.sum(p, axis=1)

        kpos = kpos_ref[pl.ds(j * st.block_k, st.block_k)]
        kseg = kseg_ref[pl.ds(j * st.block_k, st.block_k)]
        return jax.lax.cond(_block_live(qpos, qseg, kpos, kseg, st), update, lambda c: c, carry)

    init = (jnp.zeros((bq, d), jnp.float32), jnp.full((bq,), _MASKED, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, k_ref.shape[0] // st.block_k, body, init)
    seen = l > 0
    o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None],
                           0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, st: Static):
    st = st._replace(block_k=st.block_k_bwd)
    q, qpos, qseg = q_ref[...], qpos_ref[...], qseg_ref[...]
    do, lse, delta = do_ref[...], lse_ref[...], delta_ref[...]

    def body(j, dq):
        def update(dq):
            sl = pl.ds(j * st.block_k, st.block_k)
            k, v = k_ref[sl, :], v_ref[sl, :]
            s, visible = _logits_and_mask(q, k, qpos, qseg, kpos, kseg, st)
            p = jnp.where(visible, jnp.exp(s - lse[:, None]), 0.0)
            dp = plgpu.dot(do, v, trans_b=True, allow_tf32=False).astype(jnp.float32)
            ds = jnp.where(visible, p * (dp - delta[:, None]) * _softcap_grad(s, st), 0.0)
            return dq + plgpu.dot(ds.astype(k.dtype), k, allow_tf32=False)

        kpos = kpos_ref[pl.ds(j * st.block_k, st.block_k)]
        kseg = kseg_ref[pl.ds(j * st.block_k, st.block_k)]
        return jax.lax.cond(_block_live(qpos, qseg, kpos, kseg, st), update, lambda c: c, dq)

    dq = jax.lax.fori_loop(0, k_ref.shape[0] // st.block_k, body,
                           jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref, *, st: Static, groups: int):
    """One key block of one kv head; loops over (query head of the group, query block)."""
    st = st._replace(block_q=st.block_q_bwd)
    k, v, kpos, kseg = k_ref[...], v_ref[...], kpos_ref[...], kseg_ref[...]
    n_q = q_ref.shape[0] // st.block_q

    def body(idx, carry):
        g, i = jax.lax.div(idx, n_q), jax.lax.rem(idx, n_q)  # non-negative: no floor fix-up
        sl = pl.ds(i * st.block_q, st.block_q)
        qpos, qseg = qpos_ref[sl], qseg_ref[sl]

        def update(carry):
            dk, dv = carry
            q, do = q_ref[sl, g, :], do_ref[sl, g, :]
            s, visible = _logits_and_mask(q, k, qpos, qseg, kpos, kseg, st)
            p = jnp.where(visible, jnp.exp(s - lse_ref[g, sl][:, None]), 0.0)
            dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, allow_tf32=False)
            dp = plgpu.dot(do, v, trans_b=True, allow_tf32=False).astype(jnp.float32)
            ds = p * (dp - delta_ref[g, sl][:, None])
            ds = jnp.where(visible, ds * _softcap_grad(s, st), 0.0)
            return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, allow_tf32=False), dv

        return jax.lax.cond(_block_live(qpos, qseg, kpos, kseg, st), update, lambda c: c, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, groups * n_q, body, (zeros, zeros))
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(d: int) -> plgpu.CompilerParams:
    # More warps for wide heads keep the D-wide accumulators out of local memory.
    return plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2)


def _forward(q, k, v, qpos, qseg, kpos, kseg, st: Static):
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    kernel = functools.partial(_fwd_kernel, st=st)
    return pl.pallas_call(
        kernel, grid=(b, h, t // st.block_q),
        in_specs=[pl.BlockSpec((None, st.block_q, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
                  pl.BlockSpec((None, s, None, d), lambda b_, h_, i: (b_, 0, h_ // g, 0)),
                  pl.BlockSpec((None, s, None, d), lambda b_, h_, i: (b_, 0, h_ // g, 0)),
                  pl.BlockSpec((None, st.block_q), lambda b_, h_, i: (b_, i)),
                  pl.BlockSpec((None, st.block_q), lambda b_, h_, i: (b_, i)),
                  pl.BlockSpec((None, s), lambda b_, h_, i: (b_, 0)),
                  pl.BlockSpec((None, s), lambda b_, h_, i: (b_, 0))],
        out_specs=[pl.BlockSpec((None, st.block_q, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
                   pl.BlockSpec((None, None, st.block_q), lambda b_, h_, i: (b_, h_, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, h, t), jnp.float32)],
        compiler_params=_params(d), interpret=st.interpret, name="gpurl_flash_fwd",
    )(q, k, v, qpos, qseg, kpos, kseg)


def _backward(q, k, v, qpos, qseg, kpos, kseg, o, lse_BxHxT, do, st: Static):
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    delta_BxHxT = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    bq, bk = st.block_q_bwd, st.block_k_bwd
    row = lambda n: pl.BlockSpec((None, n), lambda b_, h_, i: (b_, 0))  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st), grid=(b, h, t // bq),
        in_specs=[pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
                  pl.BlockSpec((None, s, None, d), lambda b_, h_, i: (b_, 0, h_ // g, 0)),
                  pl.BlockSpec((None, s, None, d), lambda b_, h_, i: (b_, 0, h_ // g, 0)),
                  pl.BlockSpec((None, bq), lambda b_, h_, i: (b_, i)),
                  pl.BlockSpec((None, bq), lambda b_, h_, i: (b_, i)),
                  row(s), row(s),
                  pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
                  pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i)),
                  pl.BlockSpec((None, None, bq), lambda b_, h_, i: (b_, h_, i))],
        out_specs=pl.BlockSpec((None, bq, None, d), lambda b_, h_, i: (b_, i, h_, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(d), interpret=st.interpret, name="gpurl_flash_dq",
    )(q, k, v, qpos, qseg, kpos, kseg, do, lse_BxHxT, delta_BxHxT)
    # A program per (row, kv head, key block) reads the whole group's queries: K and V
    # are read once and dK, dV are written once, with no atomics and no G-fold copies.
    group = pl.BlockSpec((None, t, g, d), lambda b_, k_, j: (b_, 0, k_, 0))
    kblock = pl.BlockSpec((None, bk, None, d), lambda b_, k_, j: (b_, j, k_, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, groups=g), grid=(b, kh, s // bk),
        in_specs=[group, kblock, kblock, row(t), row(t),
                  pl.BlockSpec((None, bk), lambda b_, k_, j: (b_, j)),
                  pl.BlockSpec((None, bk), lambda b_, k_, j: (b_, j)),
                  group,
                  pl.BlockSpec((None, g, t), lambda b_, k_, j: (b_, k_, 0)),
                  pl.BlockSpec((None, g, t), lambda b_, k_, j: (b_, k_, 0))],
        out_specs=[kblock, kblock],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(d), interpret=st.interpret, name="gpurl_flash_dkv",
    )(q, k, v, qpos, qseg, kpos, kseg, do, lse_BxHxT, delta_BxHxT)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, qpos, qseg, kpos, kseg, st: Static):
    return _forward(q, k, v, qpos, qseg, kpos, kseg, st)[0]


def _flash_fwd(q, k, v, qpos, qseg, kpos, kseg, st: Static):
    o, lse = _forward(q, k, v, qpos, qseg, kpos, kseg, st)
    return o, (q, k, v, qpos, qseg, kpos, kseg, o, lse)


def _flash_bwd(st: Static, res, do):
    q, k, v, qpos, qseg, kpos, kseg, o, lse = res
    dq, dk, dv = _backward(q, k, v, qpos, qseg, kpos, kseg, o, lse, do, st)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad(x: jax.Array, axis: int, size: int) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def flash_attention(q_BxTxHxE: jax.Array, k_BxSxKxE: jax.Array, v_BxSxKxE: jax.Array,
                    q_positions_BxT: jax.Array, q_segments_BxT: jax.Array,
                    kv_positions_BxS: jax.Array, kv_segments_BxS: jax.Array, *,
                    scale: float, softcap: float | None = None, window: int | None = None,
                    block_q: int = 64, block_k: int = 64, block_q_bwd: int = 32,
                    block_k_bwd: int = 32, interpret: bool = False) -> jax.Array:
    """Masked grouped-query attention, B x T x H x D; differentiable in q, k and v.

    Decode (T = 1) folds the G query heads of each kv head into the query axis, so a
    program owns one kv head and reads its keys once for all G heads (G x less cache
    traffic, and a 16-row block holds real work instead of 1 row and 15 padded)."""
    b, t, h, d = q_BxTxHxE.shape
    kh = k_BxSxKxE.shape[2]
    if t == 1 and h > kh:
        fold = lambda x: jnp.repeat(x, h // kh, axis=1)  # noqa: E731
        q_BxQxKxE = q_BxTxHxE.reshape(b, kh, h // kh, d).swapaxes(1, 2)
        out_BxQxKxE = flash_attention(
            q_BxQxKxE, k_BxSxKxE, v_BxSxKxE, fold(q_positions_BxT), fold(q_segments_BxT),
            kv_positions_BxS, kv_segments_BxS, scale=scale, softcap=softcap, window=window,
            block_q=block_q, block_k=block_k, block_q_bwd=block_q_bwd,
            block_k_bwd=block_k_bwd, interpret=interpret)
        return out_BxQxKxE.swapaxes(1, 2).reshape(b, 1, h, d)
    s = k_BxSxKxE.shape[1]
    bq, bk = min(block_q, _pow2(t)), min(block_k, _pow2(s))
    bq_bwd, bk_bwd = min(block_q_bwd, bq), min(block_k_bwd, bk)
    st = Static(float(scale), None if softcap is None else float(softcap),
                None if window is None else int(window), bq, bk, bq_bwd, bk_bwd, interpret)
    tp, sp, dp = -(-t // bq) * bq, -(-s // bk) * bk, _pow2(d)
    q = _pad(_pad(q_BxTxHxE, 1, tp), 3, dp)
    k = _pad(_pad(k_BxSxKxE, 1, sp), 3, dp)
    v = _pad(_pad(v_BxSxKxE, 1, sp), 3, dp)
    ints = lambda x, n: _pad(x.astype(jnp.int32), 1, n)  # noqa: E731
    out = _flash(q, k, v, ints(q_positions_BxT, tp), ints(q_segments_BxT, tp),
                 ints(kv_positions_BxS, sp), ints(kv_segments_BxS, sp), st)
    return out[:, :t, :, :d]

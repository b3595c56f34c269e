"""Paged decode attention written with Pallas for GPUs (Triton lowering).

The layout and mask are those of `paged_attention.py` (the jnp reference this kernel is
tested against). One program owns one row and one key/value head: it reads the row's
length, walks only that row's own blocks through its block table (a ragged loop: a short
row reads a few blocks, whatever the batch's longest row) and keeps the online softmax's
running max, sum and output (FlashAttention-2, Dao 2023, arXiv:2307.08691, Algorithm 1,
with one query per row). With a sliding window the loop starts at the window's first
block. The Q query heads of a key/value head are padded to 16 rows, the smallest tile
Triton's dot takes. `interpret=True` runs the same kernel in Pallas's interpreter (CI).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MASKED = -1e30
_MIN_ROWS = 16  # Triton's dot tiles


def _kernel(layer_ref, table_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, *, u: int,
            scale: float, softcap: float | None, window: int | None):
    b, head = pl.program_id(0), pl.program_id(1)
    layer, length = layer_ref[0], lengths_ref[b]
    q = q_ref[b, head, :, :]  # Q' x E
    offsets = jnp.arange(u, dtype=jnp.int32)

    def block(j, carry):
        acc, m, l = carry
        ids = table_ref[b, j]
        k = k_ref[layer, ids, :, head, :]  # U x E
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=False).astype(jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        pos = j * u + offsets
        seen = pos <= length
        if window is not None:
            seen &= length - pos < window
        s = jnp.where(seen[None, :], s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(seen[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        keep = jnp.exp(m - m_new)
        v = v_ref[layer, ids, :, head, :]
        acc = acc * keep[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=False)
        return acc, m_new, l * keep + jnp.sum(p, axis=1)

    first = 0 if window is None else jnp.maximum(length - window + 1, 0) // u
    rows, e = q.shape
    init = (jnp.zeros((rows, e), jnp.float32), jnp.full((rows,), _MASKED, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(first, length // u + 1, block, init)
    o_ref[b, head, :, :] = (acc / l[:, None]).astype(o_ref.dtype)


def _per_shard(q_BxHxE, k_LxYxUxKxE, v_LxYxUxKxE, layer, table_BxI, lengths_B, *,
               scale, softcap, window, interpret):
    b, h, e = q_BxHxE.shape
    u, kv = k_LxYxUxKxE.shape[2], k_LxYxUxKxE.shape[3]
    q_per = h // kv
    rows = max(_MIN_ROWS, q_per)
    q_BxKxQxE = jnp.pad(q_BxHxE.reshape(b, kv, q_per, e), ((0, 0), (0, 0), (0, rows - q_per), (0, 0)))
    kernel = functools.partial(_kernel, u=u, scale=scale, softcap=softcap, window=window)
    out_BxKxQxE = pl.pallas_call(
        kernel, grid=(b, kv), interpret=interpret, name="gpurl_paged_decode",
        compiler_params=plgpu.CompilerParams(num_warps=4 if e <= 64 else 8, num_stages=2),
        out_shape=jax.ShapeDtypeStruct(q_BxKxQxE.shape, q_BxHxE.dtype),
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), table_BxI, lengths_B, q_BxKxQxE,
      k_LxYxUxKxE, v_LxYxUxKxE)
    return out_BxKxQxE[:, :, :q_per].reshape(b, h, e)


def paged_decode_attention(q_BxHxE: jax.Array, k_AxLxYxUxKxE: jax.Array,
                           v_AxLxYxUxKxE: jax.Array, layer: jax.Array, table_BxI: jax.Array,
                           lengths_B: jax.Array, live: jax.Array | None = None, *, scale: float,
                           softcap: float | None = None, window: int | None = None,
                           interpret: bool = False) -> jax.Array:
    """`paged_attention.paged_decode_attention` as a Pallas kernel; `live` is not needed
    (each program reads only its row's blocks)."""
    del live
    a = k_AxLxYxUxKxE.shape[0]
    split = lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:])  # noqa: E731
    fn = functools.partial(_per_shard, scale=scale, softcap=softcap, window=window,
                           interpret=interpret)
    out_AxBxHxE = jax.vmap(fn, in_axes=(0, 0, 0, None, 0, 0))(
        split(q_BxHxE), k_AxLxYxUxKxE, v_AxLxYxUxKxE, layer, split(table_BxI), split(lengths_B))
    return out_AxBxHxE.reshape(q_BxHxE.shape)

"""Decode attention over a paged KV cache: the pure-jnp reference.

The cache is a pool of blocks of U token slots per data shard (`A x L x Y x U x K x E`:
shards, layers, blocks, slots, kv heads, head width). Row b owns the blocks its block table
lists, in order: token i of the row sits in slot i % U of block `table_BxI[b, i // U]`.
Blocks are shared between rows (the G completions of one prompt list the prompt's blocks)
and a row holds only the blocks its tokens fill, so the pool's memory follows the tokens
in flight rather than rows x maximum length.

One decode step writes each row's new key and value at its position (its length so far)
and attends over its blocks with an online softmax, one block at a time up to `live`
blocks (the longest row's, a bound the host supplies): a block past a row's own length is
fully masked and leaves its running maximum, sum and output exactly unchanged, so a row's
result does not depend on the other rows of the batch. Reading only each row's own blocks
(a ragged loop per row) is the job of a GPU kernel; this reference reads up to the batch's
longest row, which on CPU costs little next to the matmuls.

Rows are split evenly over the A shards (rows of shard a are a's B / A consecutive rows)
and every gather and scatter is batched over the shard axis, so a data-sharded pool is
read and written without communication.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = float(jnp.finfo(jnp.float32).min)


def _per_shard(x: jax.Array, shards: int) -> jax.Array:
    return x.reshape(shards, x.shape[0] // shards, *x.shape[1:])


def paged_write(pool_AxLxYxUxKxE: jax.Array, layer: jax.Array, new_BxKxE: jax.Array,
                table_BxI: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """The pool with each row's new key (or value) at slot `lengths_B[b]` of its blocks."""
    a, u = pool_AxLxYxUxKxE.shape[0], pool_AxLxYxUxKxE.shape[3]

    def shard(pool_LxYxUxKxE, new_BxKxE, table_BxI, lengths_B):
        block_B = jnp.take_along_axis(table_BxI, (lengths_B // u)[:, None], axis=1)[:, 0]
        return pool_LxYxUxKxE.at[layer, block_B, lengths_B % u].set(
            new_BxKxE.astype(pool_LxYxUxKxE.dtype))

    return jax.vmap(shard)(pool_AxLxYxUxKxE, _per_shard(new_BxKxE, a), _per_shard(table_BxI, a),
                           _per_shard(lengths_B, a))


def paged_decode_attention(q_BxHxE: jax.Array, k_AxLxYxUxKxE: jax.Array,
                           v_AxLxYxUxKxE: jax.Array, layer: jax.Array, table_BxI: jax.Array,
                           lengths_B: jax.Array, live: jax.Array, *, scale: float,
                           softcap: float | None = None, window: int | None = None) -> jax.Array:
    """Attention of each row's one query (at position `lengths_B[b]`) over that row's
    tokens 0..lengths_B[b] in layer `layer` of the pool; B x H x E in the query dtype.
    `live`: blocks to visit, at least the longest row's."""
    a, u = k_AxLxYxUxKxE.shape[0], k_AxLxYxUxKxE.shape[3]
    b, h, e = q_BxHxE.shape
    kv = k_AxLxYxUxKxE.shape[4]
    offsets_U = jnp.arange(u, dtype=jnp.int32)

    def shard(q_BxHxE, k_LxYxUxKxE, v_LxYxUxKxE, table_BxI, lengths_B):
        rows = q_BxHxE.shape[0]
        q_BxKxQxE = q_BxHxE.reshape(rows, kv, h // kv, e)

        def block(j, carry):
            max_BxKxQ, sum_BxKxQ, out_BxKxQxE = carry
            ids_B = table_BxI[:, j]
            k_BxUxKxE, v_BxUxKxE = k_LxYxUxKxE[layer, ids_B], v_LxYxUxKxE[layer, ids_B]
            s_BxKxQxU = jnp.einsum("bkqe,buke->bkqu", q_BxKxQxE, k_BxUxKxE,
                                   preferred_element_type=jnp.float32) * scale
            if softcap is not None:
                s_BxKxQxU = softcap * jnp.tanh(s_BxKxQxU / softcap)
            pos_U = j * u + offsets_U
            seen_BxU = pos_U[None] <= lengths_B[:, None]
            if window is not None:
                seen_BxU &= lengths_B[:, None] - pos_U[None] < window
            seen_Bx1x1xU = seen_BxU[:, None, None, :]
            s_BxKxQxU = jnp.where(seen_Bx1x1xU, s_BxKxQxU, MASKED)
            new_max_BxKxQ = jnp.maximum(max_BxKxQ, s_BxKxQxU.max(-1))
            p_BxKxQxU = jnp.where(seen_Bx1x1xU, jnp.exp(s_BxKxQxU - new_max_BxKxQ[..., None]), 0.0)
            keep_BxKxQ = jnp.exp(max_BxKxQ - new_max_BxKxQ)
            out_BxKxQxE = out_BxKxQxE * keep_BxKxQ[..., None] + jnp.einsum(
                "bkqu,buke->bkqe", p_BxKxQxU.astype(v_BxUxKxE.dtype), v_BxUxKxE,
                preferred_element_type=jnp.float32)
            return new_max_BxKxQ, sum_BxKxQ * keep_BxKxQ + p_BxKxQxU.sum(-1), out_BxKxQxE

        init = (jnp.full((rows, kv, h // kv), MASKED, jnp.float32),
                jnp.zeros((rows, kv, h // kv), jnp.float32),
                jnp.zeros((rows, kv, h // kv, e), jnp.float32))
        _, sum_BxKxQ, out_BxKxQxE = jax.lax.fori_loop(0, live, block, init)
        return (out_BxKxQxE / sum_BxKxQ[..., None]).reshape(rows, h, e)

    out_AxBxHxE = jax.vmap(shard)(_per_shard(q_BxHxE, a), k_AxLxYxUxKxE, v_AxLxYxUxKxE,
                                  _per_shard(table_BxI, a), _per_shard(lengths_B, a))
    return out_AxBxHxE.reshape(b, h, e).astype(q_BxHxE.dtype)

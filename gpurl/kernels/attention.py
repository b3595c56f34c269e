"""The one attention function every model calls (training, prefill, decode).

`implementation` picks the kernel; this file holds the pure-jnp reference (`xla`) that
every faster kernel is tested against. Shapes: B batch, T query tokens, S key tokens,
H query heads, K key/value heads (H % K == 0), D head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla",)


def resolve(implementation: str) -> str:
    """Maps `auto` to the best implementation available on this platform."""
    if implementation == "auto":
        return "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {implementation!r} is unknown; use one of "
            f"auto, {', '.join(IMPLEMENTATIONS)}.")
    return implementation


def attention_mask(
    q_positions_BxT: jax.Array,
    kv_positions_BxS: jax.Array,
    q_segments_BxT: jax.Array,
    kv_segments_BxS: jax.Array,
    window: int | None = None,
) -> jax.Array:
    """Causal, same-segment (packing), non-padding (segment 0) and optional sliding window."""
    q_pos = q_positions_BxT[:, :, None]
    kv_pos = kv_positions_BxS[:, None, :]
    mask_BxTxS = (kv_pos <= q_pos) & (q_segments_BxT[:, :, None] == kv_segments_BxS[:, None, :])
    mask_BxTxS &= kv_segments_BxS[:, None, :] != 0
    if window is not None:
        mask_BxTxS &= q_pos - kv_pos < window
    return mask_BxTxS


def attention(
    q_BxTxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    mask_BxTxS: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    implementation: str = "xla",
) -> jax.Array:
    """Grouped-query attention; returns B x T x H x D in the query dtype."""
    resolve(implementation)
    return _xla_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale, softcap)


def _xla_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale, softcap):
    b, t, h, d = q_BxTxHxD.shape
    k = k_BxSxKxD.shape[2]
    q_BxTxKxGxD = q_BxTxHxD.reshape(b, t, k, h // k, d)
    logits_BxKxGxTxS = jnp.einsum(
        "btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD, preferred_element_type=jnp.float32)
    logits_BxKxGxTxS *= scale
    if softcap is not None:
        logits_BxKxGxTxS = softcap * jnp.tanh(logits_BxKxGxTxS / softcap)
    mask = mask_BxTxS[:, None, None, :, :]
    logits_BxKxGxTxS = jnp.where(mask, logits_BxKxGxTxS, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits_BxKxGxTxS, axis=-1)
    # Rows with no visible key (padding queries) would average all values; zero them.
    probs = jnp.where(mask, probs, 0.0).astype(v_BxSxKxD.dtype)
    out_BxTxKxGxD = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxD)
    return out_BxTxKxGxD.reshape(b, t, h, d)

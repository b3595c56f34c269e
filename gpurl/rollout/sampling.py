"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def allowed_logits(scaled_BxV: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Logits with tokens outside the top-k / top-p set at -inf.

    Top-p keeps the smallest set of most likely tokens whose probability reaches `top_p`
    (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", eq. 2); the most
    likely token is always kept. Ties at the threshold are all kept."""
    if top_k > 0 and top_k < scaled_BxV.shape[-1]:
        kth_Bx1 = jax.lax.top_k(scaled_BxV, top_k)[0][:, -1:]
        scaled_BxV = jnp.where(scaled_BxV < kth_Bx1, NEG_INF, scaled_BxV)
    if top_p < 1.0:
        sorted_BxV = jnp.sort(scaled_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # mass of strictly better tokens
        kept_BxV = before_BxV < top_p
        threshold_Bx1 = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
        scaled_BxV = jnp.where(scaled_BxV < threshold_Bx1, NEG_INF, scaled_BxV)
    return scaled_BxV


def sample(logits_BxV: jax.Array, keys_B: jax.Array, temperature: float, top_k: int,
           top_p: float) -> tuple[jax.Array, jax.Array]:
    """(tokens_B, logprobs_B); logprobs under log_softmax(logits / temperature), untruncated
    (under log_softmax(logits) when greedy)."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if temperature == 0.0:
        tokens_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
    else:
        scaled_BxV = logits_BxV / temperature
        logp_BxV = jax.nn.log_softmax(scaled_BxV, axis=-1)
        filtered_BxV = allowed_logits(scaled_BxV, top_k, top_p)
        tokens_B = inverse_cdf_sample(keys_B, filtered_BxV)
    return tokens_B, jnp.take_along_axis(logp_BxV, tokens_B[:, None], axis=-1)[:, 0]


def inverse_cdf_sample(keys_B: jax.Array, logits_BxV: jax.Array) -> jax.Array:
    """One draw per row from softmax(logits) by inverting the CDF with a single uniform.

    Exact in distribution like Gumbel-max (`jax.random.categorical`), which needs V random
    numbers per row: with a 262k vocabulary those dominate a CPU decode step."""
    probs_BxV = jax.nn.softmax(logits_BxV.astype(jnp.float32), axis=-1)
    cdf_BxV = jnp.cumsum(probs_BxV, axis=-1)
    u_B = jax.vmap(jax.random.uniform)(keys_B)
    # u > 0 so a zero-probability first token is never chosen; scale to the CDF's total.
    u_Bx1 = (jnp.maximum(u_B, 1e-30) * cdf_BxV[:, -1])[:, None]
    tokens_B = jnp.sum(cdf_BxV < u_Bx1, axis=-1)
    return jnp.minimum(tokens_B, logits_BxV.shape[-1] - 1).astype(jnp.int32)

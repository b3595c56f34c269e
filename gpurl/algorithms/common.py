"""Shared pieces of every algorithm: the objective interface and target shifting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

Batch = dict[str, jax.Array]
# (apply, params, micro_batch, normalizer) -> (loss, metrics). The loss is this
# micro-batch's share of the global-batch loss, so shares add up across micro-batches;
# every metric must be additive the same way.
LossFn = Callable[[Callable[..., jax.Array], Any, Batch, jax.Array], tuple[jax.Array, dict]]


@dataclass(frozen=True)
class Objective:
    loss: LossFn
    normalizer: Callable[[Batch], jax.Array]  # computed once on the global batch


def shifted_targets(batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Targets for logits[:, :-1]: token t+1 and its loss weight (0 across packed segments,
    since the first token of a segment carries no loss)."""
    return batch["tokens"][:, 1:], batch["loss_mask"][:, 1:]


def token_logprobs(apply: Callable[..., jax.Array], params: Any, batch: Batch,
                   temperature: float = 1.0) -> jax.Array:
    """log p(token t+1 | tokens <= t) for t < T-1 (B x T-1, fp32), with logits divided by
    the sampling temperature so it matches the sampler's log-probabilities."""
    logits_BxTxV = apply(params, batch["tokens"], batch["positions"], batch["segment_ids"])
    logits_BxTxV = logits_BxTxV[:, :-1].astype(jnp.float32) / (temperature or 1.0)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    return jnp.take_along_axis(logp_BxTxV, batch["tokens"][:, 1:, None], axis=-1)[..., 0]

"""Shared pieces of every algorithm: the objective interface and target shifting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax

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

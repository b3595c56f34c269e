"""The interface every algorithm's objective implements for the shared train step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax

Batch = dict[str, jax.Array]
# (model spec, params, micro_batch, normalizer) -> (loss, metrics). The loss is this
# micro-batch's share of the global-batch loss, so shares add up across micro-batches;
# every metric must be additive the same way.
LossFn = Callable[[Any, Any, Batch, Any], tuple[jax.Array, dict]]


@dataclass(frozen=True)
class Objective:
    loss: LossFn
    normalizer: Callable[[Batch], Any]  # computed once on the global batch

"""The trainer's policy as a batch source takes it: its parameters in the rollout layout
(`gpurl.distributed.sync.WeightSync`), and the host time at which the trainer's latest
update was first seen computed (where the step's measured train time ends)."""

from __future__ import annotations

import time
from typing import Any

import jax

from gpurl.distributed.sync import WeightSync


class PolicyWeights:
    """Takes the trainer's policy (a tree of device arrays, possibly still being computed)
    into the rollout layout. `computed_at` is the host time at which the update that made
    the tree was first seen finished, since the last `start` (None: not yet seen)."""

    def __init__(self, sync: WeightSync):
        self.sync = sync
        self.colocated = sync.colocated
        self.computed_at: float | None = None

    def start(self) -> None:
        """A new step: nothing seen computed yet."""
        self.computed_at = None

    def computed(self, policy: Any) -> bool:
        """Whether every array of `policy` is computed (this process; no waiting)."""
        done = all(x.is_ready() for x in jax.tree.leaves(policy))
        if done:
            self._seen()
        return done

    def take(self, policy: Any) -> tuple[Any, float]:
        """(`policy` in the rollout layout, the seconds the sync took), once the update that
        computes it is done (waited for: its time is the previous step's train time)."""
        jax.block_until_ready(policy)
        self._seen()
        t0 = time.perf_counter()
        params = jax.block_until_ready(self.sync(policy))
        return params, time.perf_counter() - t0

    def _seen(self) -> None:
        if self.computed_at is None:
            self.computed_at = time.perf_counter()


def corrected(correction: str | None) -> str:
    """How the start-up line says off-policy tokens are corrected (`correction`: the
    algorithm's correction, None when algo.async_correction=false)."""
    return f"corrected by {correction}" if correction else "uncorrected (algo.async_correction=false)"

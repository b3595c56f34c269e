"""Where an RL step's batch comes from: one batch source per `rollout.mode`, behind one
protocol the RL step pulls from.

    sync:       each step takes the trainer's weights, samples its rounds, then trains
    one_ahead:  as sync, but step s+1's first round is sampled while step s trains, with
                the weights step s started from (split placement; one step off-policy)
    continuous: the engine never stops; weights enter between decode chunks, each step
                trains the first groups that finish (`gpurl.rollout.continuous`)

The step hands a source the trainer's policy (device arrays, possibly still being
computed) and receives a `Collected` batch on the trainer mesh; after dispatching its train
step it calls `after_dispatch`, where one_ahead samples the next step's first round. A
source syncs weights itself (`PolicyWeights`) and reports when the trainer's last update
was first seen computed (`Collected.computed_at`), so nothing calls back into the trainer.

This module is the only reader of `rollout.mode`.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from gpurl.config import ConfigError, RolloutConfig, RolloutMode
from gpurl.rollout.collect import Collected, Collector
from gpurl.rollout.continuous import Continuous
from gpurl.rollout.prompts import Prompts
from gpurl.rollout.rounds import Round
from gpurl.rollout.weights import PolicyWeights, corrected


class BatchSource(Protocol):
    """What the RL step pulls its batches from."""

    # batches may hold tokens sampled by weights older than the step's (the loss corrects)
    off_policy: bool
    # batches of rows the engine's KV pool holds at once (the memory plan sizes it)
    batches_in_flight: int
    # the engine keeps one stream for the run (an evaluation needs a pool beside it)
    streams: bool

    def next(self, step: int, policy: Any) -> Collected:
        """Step `step`'s batch; `policy` is the trainer's policy at the step's start."""

    def after_dispatch(self, step: int) -> float | None:
        """Called once step `step`'s train step is dispatched: rollout work overlapped with
        it, and the host seconds it took (None: this source overlaps nothing)."""

    def describe(self, correction: str | None) -> str:
        """The start-up line's rollout clause (`correction`: how off-policy tokens are
        corrected, None when they are not)."""

    def state_meta(self) -> dict[str, Any]:
        """Host state a checkpoint records: the data position and what is in flight."""

    def restore_meta(self, meta: dict) -> None:
        """The state `state_meta` recorded."""


class Synchronous:
    """`rollout.mode=sync`: every step samples its rounds with its own starting weights."""

    off_policy = False
    batches_in_flight = 1
    streams = False

    def __init__(self, collector: Collector, weights: PolicyWeights, note: str = ""):
        self.collector, self.weights, self.note = collector, weights, note
        self.params: Any = None  # the weights of the latest rounds, in the rollout layout

    def next(self, step: int, policy: Any) -> Collected:
        self.weights.start()
        self.params, sync_s = self.weights.take(policy)
        got = self.collector.collect(self.params, step, self._ahead(step))
        got.metrics["time/sync_s"] = sync_s
        got.computed_at = self.weights.computed_at
        return got

    def _ahead(self, step: int) -> Round | None:
        return None

    def after_dispatch(self, step: int) -> float | None:
        return None

    def describe(self, correction: str | None) -> str:
        return self.note or (f", sampler/trainer mismatch corrected by {correction}"
                             if correction else "")

    def state_meta(self) -> dict[str, Any]:
        return {"data_position": float(self.collector.position)}

    def restore_meta(self, meta: dict) -> None:
        # checkpoints written before the position was recorded drew one batch per round
        # a step could run (dynamic sampling: 1 + algo.max_refills, whether or not they ran)
        legacy = int(meta.get("step", 0)) * self.collector.rounds
        self.collector.position = int(meta.get("data_position", legacy))


class OneAhead(Synchronous):
    """`rollout.mode=one_ahead` (split placement): step s+1's first round is sampled while
    step s trains, with the weights step s started from; the prepare step computes pi_old
    and the loss corrects for the lag (`gpurl.algorithms.behaviour.behaviour_weights`)."""

    off_policy = True

    def __init__(self, collector: Collector, weights: PolicyWeights, steps: int):
        super().__init__(collector, weights)
        self.steps = steps
        self.prefetched: tuple[int, Round] | None = None  # (its step, round 0 of that step)

    def _ahead(self, step: int) -> Round | None:
        ahead, self.prefetched = self.prefetched, None
        return ahead[1] if ahead is not None and ahead[0] == step else None

    def after_dispatch(self, step: int) -> float | None:
        if step + 1 >= self.steps:
            return 0.0
        t0 = time.perf_counter()
        self.prefetched = (step + 1, self.collector.round(self.params, step + 1, 0))
        return time.perf_counter() - t0

    def describe(self, correction: str | None) -> str:
        return f", rollouts one step ahead {corrected(correction)}"

    def state_meta(self) -> dict[str, Any]:
        # a round sampled ahead for the next step is not kept: a resumed run draws it again
        ahead = 1 if self.prefetched is not None else 0
        return {"data_position": float(self.collector.position - ahead)}


def check_mode(cfg: RolloutConfig, placement: str) -> None:
    """Continuous rollouts need their own devices (mesh.placement=split)."""
    if RolloutMode(cfg.mode) is RolloutMode.CONTINUOUS and placement != "split":
        raise ConfigError("rollout.mode=continuous needs mesh.placement=split (rollouts "
                          "and training on their own devices); colocated runs are sync "
                          "or one step ahead (rollout.mode=one_ahead).")


def batch_source(cfg: RolloutConfig, collector: Collector, weights: PolicyWeights,
                 prompts: Prompts, *, group: int, batch_size: int, seed: int,
                 steps: int) -> BatchSource:
    """The source of `rollout.mode`. Colocated, one_ahead has nothing to overlap with
    (rollouts and training share the devices) and runs synchronously, saying so;
    continuous refuses colocated placement (`check_mode`)."""
    check_mode(cfg, "colocated" if weights.colocated else "split")
    mode = RolloutMode(cfg.mode)
    if mode is RolloutMode.CONTINUOUS:
        if prompts.pixels_shape is not None:
            raise ConfigError("prompts with images cannot be sampled in rollout.mode=continuous "
                              "yet (its checkpoints hold the requests); use rollout.mode=sync "
                              "or one_ahead.")
        return Continuous(collector, weights, prompts, cfg, group, batch_size, seed)
    if mode is RolloutMode.ONE_AHEAD and not weights.colocated:
        return OneAhead(collector, weights, steps)
    note = (", rollout.mode=one_ahead has no effect with colocated placement (rollouts and "
            "training share the devices; mesh.placement=split overlaps them)"
            if mode is RolloutMode.ONE_AHEAD else "")
    return Synchronous(collector, weights, note)

"""The interface every algorithm's objective implements for the shared train step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.struct
import jax

Batch = dict[str, jax.Array]
# (model spec, params, micro_batch, normalizer[, teacher]) -> (loss, metrics). The loss is
# this micro-batch's share of the global-batch loss, so shares add up across
# micro-batches; every metric must be additive the same way, but for maxima, whose names
# end in MAXIMUM (`reduce_micro`). Only an objective that declares `takes_teacher` (a
# distillation algorithm's) receives the run's frozen teacher (`Teacher`).
LossFn = Callable[..., tuple[jax.Array, dict]]
MAXIMUM = "_max"


def reduce_micro(metrics_M: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """One step's metrics from the M micro-batches' (each M-leading): shares summed,
    maxima (names ending in MAXIMUM) the largest."""
    return {k: m.max(0) if k.endswith(MAXIMUM) else m.sum(0) for k, m in metrics_M.items()}


@dataclass(frozen=True)
class Objective:
    loss: LossFn
    normalizer: Callable[[Batch], Any]  # computed once on the global batch
    takes_teacher: bool = False  # the loss's last argument is the frozen teacher

    def apply(self, spec: Any, params: Any, batch: Batch, norm: Any,
              teacher: Any = None) -> tuple[jax.Array, dict]:
        """The loss, given the frozen teacher only when it declares it takes one."""
        if self.takes_teacher:
            return self.loss(spec, params, batch, norm, teacher)
        return self.loss(spec, params, batch, norm)


class TeacherModel:
    """A frozen teacher's model spec, static under jit: compared and hashed by identity
    (a spec holds dicts of abstract arrays, which do not hash), so the one object a run
    builds keeps every call on the same compiled program."""

    def __init__(self, spec: Any):
        self.spec = spec


@flax.struct.dataclass
class Teacher:
    """What the train and prepare steps of a distillation algorithm receive beside the
    student: the teacher's frozen parameters (arrays on the trainer mesh, never
    differentiated) and its model."""

    params: Any
    model: TeacherModel = flax.struct.field(pytree_node=False)

    @property
    def spec(self) -> Any:
        return self.model.spec

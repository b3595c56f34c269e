"""The interface every algorithm's objective implements for the shared train step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.struct
import jax

Batch = dict[str, jax.Array]
# (model spec, params, micro_batch, normalizer, teacher) -> (loss, metrics). The loss is
# this micro-batch's share of the global-batch loss, so shares add up across
# micro-batches; every metric must be additive the same way. `teacher` is the run's frozen
# teacher (`Teacher`) for a distillation algorithm, None otherwise.
LossFn = Callable[[Any, Any, Batch, Any, Any], tuple[jax.Array, dict]]


@dataclass(frozen=True)
class Objective:
    loss: LossFn
    normalizer: Callable[[Batch], Any]  # computed once on the global batch


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

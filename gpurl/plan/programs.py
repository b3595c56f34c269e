"""What a stepper hands the plan: a record of each program it runs (its kind, the jitted
function, abstract arguments, the unit of work one call does), and the shape of a step's
rollout round. The plan, the account and the lowering tests match programs by `Kind`,
never by their display names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Kind(enum.Enum):
    """What a program does in a step; its value is the name tables print."""

    TRAIN = "train step"  # the shared train step (gradients, optimizer update)
    EVAL = "eval step"  # the train step's loss without an update (SFT's held-out rows)
    PREPARE = "prepare"  # RL: old, reference and reward-model log-probs, advantages
    SEQUENCE_LOGPS = "sequence log-probs"  # preference: the reference's, held-out pairs'
    ROLLOUT = "rollout"  # a rollout round: its prefill and decode chunk, planned as one
    PREFILL = "rollout prefill"  # the rollout's prompts in one call
    DECODE = "rollout decode chunk"  # rollout.decode_chunk tokens of every row


@dataclass(frozen=True)
class ProgramRecord:
    """One program a step runs, as the plan compiles it ahead of time."""

    kind: Kind
    fn: Any  # the jitted function (`.trace`, `.lower`)
    args: tuple  # its abstract arguments (ShapeDtypeStructs with shardings)
    unit: str = "call"  # the work one call does

    @property
    def name(self) -> str:
        return self.kind.value


@dataclass
class RolloutRound:
    """A step's rollout round as the plan compiles it: `rows` requests per process of
    prompts `width` tokens wide, in runs of `group` identical ones, on `engine`."""

    engine: Any  # `gpurl.rollout.engine.Engine`
    rows: int
    width: int
    group: int
    in_flight: int = 1  # batches a stream holds at once (continuous: several)
    eval_rows: int = 0  # an evaluation's requests per process whose pool sits beside it
    resident: float = 0.0  # bytes per device that stay beside it (colocated: the train state)
    notes: list[str] = field(default_factory=list)

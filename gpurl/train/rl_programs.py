"""What the memory plan and the GPU compiler's account read of an RL step (`RLStepper`):
the prepared batch's shapes, the records of the programs a step runs besides the train
step (the prepare step, the rollout round's prefill and decode chunk), the rollout round's
shape and what stays resident beside each program. Nothing here runs a step.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from gpurl.data import packing
from gpurl.data.rollouts import RolloutBatch
from gpurl.distributed import runtime
from gpurl.distributed.mesh import abstract, sharded
from gpurl.plan.programs import Kind, ProgramRecord, RolloutRound
from gpurl.rollout.requests import prompt_width


class RLPrograms:
    """The plan's side of `RLStepper`, which holds the parts it reads: `setup`, `train`,
    `algo`, `collector`, `rounds`, `engine`, `sync`, `source`, `frozen`, `layout`, the
    prepare step and its `carry`, and the packed rows' `budget`, `shards` and `context`."""

    def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The prepared batch's shapes: the collector's arrays through the prepare step."""
        return jax.eval_shape(self._prepare, *self._prepare_args(*self._collected_spec()))[0]

    def _collected_spec(self) -> tuple[RolloutBatch, dict | None]:
        """The collector's batch (`Collector.spec`) and, packed, the plan's arrays for a
        longest prompt and completion (w + n slots; None: not packed)."""
        rollout = self.collector.spec()
        if not self.train.packed:
            return rollout, None
        (p, g, n), w = rollout.completions.shape, rollout.prompt_tokens.shape[1]
        return rollout, packing.planned_spec(p, g, w + n, n, self.budget, self.shards, self.context)

    def _prepare_args(self, rollout: RolloutBatch, packed: dict | None) -> tuple:
        """The prepare step's arguments, abstract, for a collected batch's shapes."""
        place, rows = self.setup.place, self.train.batch_size * self.group
        return (abstract(place.abstract_state.params, place.state.params), *self.frozen.abstract(),
                rollout, packed, jax.ShapeDtypeStruct((rows,), jnp.float32), self.carry)

    def programs(self) -> list[ProgramRecord]:
        """The prepare step and the rollout round's prefill and decode chunk."""
        collected = sharded(self._collected_spec(), self.setup.place.batch)  # both parts
        r = self.rollout_round()
        prefill, decode = self.engine.round_programs(r.rows, r.width, r.group)
        return [ProgramRecord(Kind.PREPARE, self._prepare, self._prepare_args(*collected),
                              "call (the step's batch)"),
                ProgramRecord(Kind.PREFILL, *prefill, f"call ({r.rows} requests per process)"),
                ProgramRecord(Kind.DECODE, *decode, "call (rollout.decode_chunk tokens a row)")]

    def rollout_round(self) -> RolloutRound:
        """A step's rollout round: batch_size x G rows at the run's prompt width, the
        batches a stream holds at once, and (colocated) the train state and frozen models
        beside it; an evaluation's pool beside a stream's."""
        rows, g = self.train.batch_size * self.group, self.group
        count = runtime.process_count()
        resident = 0.0
        if self.sync.colocated:  # what is not shared with the sampling copy stays beside it
            shared = self.sync.held_bytes(self._policy_abstract())[1]
            resident = self.setup.place.state_bytes() - shared + self.frozen.bytes_per_device()
        evals = -(-self.train.eval_batch_size // count) if self.source.streams and self.has_eval else 0
        return RolloutRound(self.engine, rows // count, self.rounds.plan_width,
                            math.gcd(g, rows // max(self.engine.mesh.shape["data"], 1)),
                            self.source.batches_in_flight, evals, resident, [self.layout])

    def resident_bytes(self) -> float:
        """Beside the train step: the frozen models and, colocated, the sampling copy (a
        teacher is one of the train step's arguments: the plan counts it there)."""
        copy = self.sync.held_bytes(self._policy_abstract())[0] if self.sync.colocated else 0.0
        return self.frozen.bytes_per_device(teacher=False) + copy

    def _policy_abstract(self) -> Any:
        return self.setup.spec.policy_params(self.setup.place.abstract_state.params)

    def close(self) -> None:
        """The agents' gateway (env=agent) stops with the run."""
        self.rounds.close()

    def plan_prompt_len(self, tokens: int) -> None:
        """Rollouts of prompts padded to `tokens` (rounded up to a bucket) instead of the
        data's longest: what `gpurl plan` compiles and counts."""
        self.rounds.prompt_width = prompt_width(tokens)

"""What a stepper is: the per-family part of the loop that turns step s into a batch (and,
for RL, rollouts), calls the shared jitted train step, and evaluates.

The loop builds the pieces every family needs (`Setup`) and picks the stepper of the
algorithm's family (`gpurl.train.loop.STEPPERS`); each stepper takes its own config
sections from the root config in `build` and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

from gpurl.algorithms.objective import Objective
from gpurl.algorithms.registry import Algorithm
from gpurl.config import AlgoConfig, Config, ConfigError, MeshConfig
from gpurl.distributed import host
from gpurl.distributed.mesh import abstract, sharded
from gpurl.models.tokenizer import Tokenizer
from gpurl.plan.programs import Kind, ProgramRecord, RolloutRound
from gpurl.rollout.suites import SuiteEvaluation
from gpurl.train.frozen import Frozen
from gpurl.train.step import Placement, TrainState


@dataclass(frozen=True)
class Setup:
    """What the loop built for the stepper."""

    algorithm: Algorithm  # the algorithm's registry record
    algo: AlgoConfig  # its config
    spec: Any  # the trained tree's spec
    objective: Objective
    tokenizer: Tokenizer
    place: Placement  # where state and batches live on the trainer mesh
    # the jitted train step (state, batch, teacher, num_micro=None) -> (state, metrics)
    step_fn: Callable[..., tuple[TrainState, dict]]
    init: Callable[[], TrainState]  # a fresh state (initial weights, new optimizer)
    frozen: Frozen = Frozen()  # the frozen models by role (reference, reward model, teacher)

    @property
    def teacher(self) -> Any:
        """A distillation algorithm's `TeacherWeights`; None without one."""
        return self.frozen.teacher

    def frozen_teacher(self) -> Any:
        """The teacher the train step takes: its parameters (read at the first call), or
        None without one."""
        return None if self.teacher is None else self.teacher.value

    def abstract_teacher(self) -> Any:
        """The teacher's abstract arguments for compiling ahead of time; None without one."""
        return None if self.teacher is None else self.teacher.abstract

    def train_program(self, batch: dict[str, jax.ShapeDtypeStruct]) -> ProgramRecord:
        """The train step's record for a batch of these global shapes (`Stepper.batch_spec`)."""
        state = abstract(self.place.abstract_state, self.place.state)
        return ProgramRecord(Kind.TRAIN, self.step_fn.jitted,
                             (state, sharded(batch, self.place.batch), self.abstract_teacher()),
                             "call (a step's batch, its micro-batches accumulated)")

    def to_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Each process passes only its own rows; JAX assembles the global sharded batch."""
        return {k: host.to_device(v, self.place.batch) for k, v in batch.items()}


class Stepper:
    """The interface the loop drives; the defaults fit a stepper without held-out data or
    host state."""

    eval_at_start = False  # evaluate before the first step too (RL, preference)
    has_eval = False  # there are held-out rows to evaluate on
    # train.suites, sampled by the stepper's `sampler` (set by the loop); None without
    suites: SuiteEvaluation | None = None

    @property
    def has_suites(self) -> bool:
        return self.suites is not None

    @classmethod
    def build(cls, setup: Setup, cfg: Config) -> "Stepper":
        raise NotImplementedError

    @staticmethod
    def trainer_devices(mesh: MeshConfig) -> Sequence[jax.Device] | None:
        """The devices of the trainer mesh; None: all of them."""
        return None

    def describe(self) -> str:
        """The data summary of the start-up line."""
        raise NotImplementedError

    def step(self, state: TrainState, step: int) -> tuple[TrainState, dict]:
        """Dispatches step `step`; its metrics are device values the loop reads late."""
        raise NotImplementedError

    def evaluate(self, params: Any) -> dict[str, float]:
        """The held-out figures of the trained `params` (a stepper that samples: through
        `sampler` and `evaluate_sampled`)."""
        return self.evaluate_sampled(self.sampler()[1](params))

    def evaluate_sampled(self, params: Any) -> dict[str, float]:
        """The held-out figures of `params` already in the sampler's layout."""
        raise NotImplementedError

    def sampler(self) -> tuple[Any, Callable[[Any], Any]] | None:
        """(the rollout engine, the trained parameters -> the engine's layout) of a stepper
        that samples (RL), for evaluations by sampling (`train.suites`); None otherwise."""
        return None

    def evaluations(self, params: Any, held_out: bool, suites: bool) -> dict[str, float]:
        """The held-out figures and/or `train.suites`' (`eval/<suite>/avg@n`, ...) of the
        trained `params`, whichever is due; with suites, the weights go to the sampler's
        layout once for both."""
        if not suites:
            return self.evaluate(params) if held_out else {}
        sampled = self.sampler()[1](params)
        return {**(self.evaluate_sampled(sampled) if held_out else {}), **self.suites(sampled)}

    def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Global shapes and dtypes of the train step's batch (the memory plan compiles it)."""
        raise NotImplementedError

    def resident_bytes(self) -> float:
        """Bytes per device that stay beside the train state (a frozen reference)."""
        return 0.0

    def programs(self) -> list[ProgramRecord]:
        """A record of each program the stepper runs besides the train step: what the
        account charges and `gpurl.train.lowering` lowers for another platform."""
        return []

    def rollout_round(self) -> RolloutRound | None:
        """A step's rollout round as the plan compiles it (`gpurl.plan.memory.plan_rollout`);
        None without a rollout."""
        return None

    def plan_prompt_len(self, tokens: int) -> None:
        """`plan.prompt_len`: plan for prompts of `tokens` tokens (gpurl plan's what-if)."""
        raise ConfigError(f"plan.prompt_len={tokens} sizes the prompts of RL rollouts; for this "
                          f"algorithm set data.max_len and data instead.")

    def state_meta(self) -> dict[str, float]:
        """Host state a checkpoint records beside the arrays."""
        return {}

    def restore_meta(self, meta: dict) -> None:
        pass

    def close(self) -> None:
        """Releases what the stepper holds outside JAX (servers, threads) at the run's end."""

"""What an RL algorithm's prepare step receives: the step between the rollout and the
train step that turns scored completions into what the loss reads (reference and old
log-probs, advantages; PPO's values and returns). It runs jitted, outside the
differentiated function, on the trainer mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import flax.struct
import jax

from gpurl.algorithms.objective import Batch
from gpurl.models.scalar import ScalarSpec


@dataclass(frozen=True)
class RLContext:
    """What a prepare step knows statically."""

    spec: Any  # the trained tree's spec (its `policy` is the language model)
    temperature: float  # sampling temperature: log-probs are those of the sampled distribution
    reward_model: ScalarSpec | None = None  # algo.reward_model's spec
    # the batch may hold rounds sampled a step ahead by the previous parameters
    # (rollout.mode=one_ahead with split placement): pi_old is computed and the batch corrected
    off_policy: bool = False
    # rows one trajectory takes (agents, env.agent_rows): a group's advantages are its
    # trajectories', each counted once (`group_advantages`)
    rows_per_trajectory: int = 1


@flax.struct.dataclass
class RLInputs:
    """The arrays of one prepare step."""

    params: Any  # the trained tree
    ref_params: Any  # the frozen reference policy; None without a KL term
    reward_model: Any  # the reward model's parameters; None without one
    # the rollout batch's arrays by field (`gpurl.data.rollouts.RolloutBatch.arrays`) and,
    # packed, the packed layout's (`gpurl.data.packing.gather`)
    batch: Batch
    rewards: jax.Array  # B: the shaped total of the reward functions per row
    carry: dict[str, jax.Array]  # the algorithm's state between steps (PPO: kl_coef)
    teacher: Any = None  # a distillation algorithm's frozen `Teacher`; None without one


# (algo config, context, inputs) -> (batch the loss reads, metrics, next carry)
Prepare = Callable[[Any, RLContext, RLInputs], tuple[Batch, dict, dict]]

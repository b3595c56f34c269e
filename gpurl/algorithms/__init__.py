"""Algorithms as pure objectives over arrays, looked up by `algo.name`.

GRPO, GSPO, DAPO, Dr. GRPO and RLOO are one objective (`grpo.grpo_objective`) whose
terms are chosen by config; PPO adds a critic (`ppo.ppo_objective`); DPO (with IPO /
hinge / conservative losses), SimPO and ORPO are another (`dpo.preference_objective`);
reward models train with Bradley-Terry (`rm.rm_objective`). The presets in configs/algo/
set each paper's values. `model` gives the parameter tree each algorithm trains: the
language model, a scalar-head model (rm), or the policy with its critic (ppo).
"""

from __future__ import annotations

from typing import Callable

from gpurl.algorithms.common import Objective
from gpurl.algorithms.dpo import preference_objective
from gpurl.algorithms.grpo import grpo_objective
from gpurl.algorithms.ppo import ppo_objective
from gpurl.algorithms.rm import rm_objective
from gpurl.algorithms.sft import sft_objective
from gpurl.config import PREFERENCE_ALGOS, RL_ALGOS, AlgoName, Config, ConfigError, ModelConfig


def _grpo(cfg: Config) -> Objective:
    return grpo_objective(cfg.algo, cfg.rollout.max_new_tokens, cfg.rollout.temperature)


OBJECTIVES: dict[str, Callable[[Config], Objective]] = {
    AlgoName.SFT.value: lambda cfg: sft_objective(cfg.algo),
    **{name: _grpo for name in RL_ALGOS},
    **{name: (lambda cfg: preference_objective(cfg.algo)) for name in PREFERENCE_ALGOS},
    AlgoName.PPO.value: lambda cfg: ppo_objective(cfg.algo, cfg.rollout.max_new_tokens,
                                                  cfg.rollout.temperature),
    AlgoName.RM.value: lambda cfg: rm_objective(),
}


def model(cfg: Config, model_cfg: ModelConfig):
    """The spec of what `cfg.algo` trains (see the module docstring)."""
    from gpurl.models import model_spec
    from gpurl.models.scalar import ActorCriticSpec, scalar_spec

    if cfg.algo.name == AlgoName.RM.value:
        return scalar_spec(model_cfg)
    if cfg.algo.name == AlgoName.PPO.value:
        return ActorCriticSpec(model_spec(model_cfg), scalar_spec(model_cfg),
                               shared=cfg.algo.critic == "shared")
    return model_spec(model_cfg)


def policy_spec(spec):
    """The language model inside `spec` (itself, or PPO's policy); None for a reward model."""
    from gpurl.models.scalar import ActorCriticSpec, ScalarSpec

    if isinstance(spec, ActorCriticSpec):
        return spec.policy
    return None if isinstance(spec, ScalarSpec) else spec


def policy_params(spec, params):
    """The language model's parameters inside `params` (see `policy_spec`)."""
    from gpurl.models.scalar import ActorCriticSpec

    return params["policy"] if isinstance(spec, ActorCriticSpec) else params


def is_rl(cfg: Config) -> bool:
    """Whether the algorithm learns from sampled completions and rewards."""
    return cfg.algo.name in RL_ALGOS


def is_preference(cfg: Config) -> bool:
    """Whether the algorithm learns from (prompt, chosen, rejected) pairs."""
    return cfg.algo.name in PREFERENCE_ALGOS


def objective(cfg: Config) -> Objective:
    try:
        return OBJECTIVES[cfg.algo.name](cfg)
    except KeyError:
        names = ", ".join(OBJECTIVES)
        raise ConfigError(f"algo={cfg.algo.name!r} is not available; use one of: {names}.") from None

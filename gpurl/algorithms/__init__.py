"""Algorithms as pure objectives over arrays, looked up by `algo.name`.

GRPO, GSPO, DAPO, Dr. GRPO and RLOO are one objective (`grpo.grpo_objective`) whose
terms are chosen by config; DPO (with IPO / hinge / conservative losses), SimPO and ORPO
are another (`dpo.preference_objective`); the presets in configs/algo/ set each paper's
values.
"""

from __future__ import annotations

from typing import Callable

from gpurl.algorithms.common import Objective
from gpurl.algorithms.dpo import preference_objective
from gpurl.algorithms.grpo import grpo_objective
from gpurl.algorithms.sft import sft_objective
from gpurl.config import PREFERENCE_ALGOS, RL_ALGOS, AlgoName, Config, ConfigError


def _grpo(cfg: Config) -> Objective:
    return grpo_objective(cfg.algo, cfg.rollout.max_new_tokens, cfg.rollout.temperature)


OBJECTIVES: dict[str, Callable[[Config], Objective]] = {
    AlgoName.SFT.value: lambda cfg: sft_objective(cfg.algo),
    **{name: _grpo for name in RL_ALGOS},
    **{name: (lambda cfg: preference_objective(cfg.algo)) for name in PREFERENCE_ALGOS},
}


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

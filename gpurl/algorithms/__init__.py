"""Algorithms as pure objectives over arrays, looked up by `algo.name`."""

from __future__ import annotations

from typing import Callable

from gpurl.algorithms.common import Objective
from gpurl.algorithms.sft import sft_objective
from gpurl.config import AlgoConfig, AlgoName, ConfigError

OBJECTIVES: dict[AlgoName, Callable[[AlgoConfig], Objective]] = {AlgoName.SFT: sft_objective}


def objective(cfg: AlgoConfig) -> Objective:
    try:
        return OBJECTIVES[AlgoName(cfg.name)](cfg)
    except (KeyError, ValueError):
        names = ", ".join(a.value for a in OBJECTIVES)
        raise ConfigError(f"algo={cfg.name!r} is not available; use one of: {names}.") from None

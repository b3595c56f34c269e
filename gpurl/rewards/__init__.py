"""Reward functions: built-ins by name and user functions by "pkg.module:function".

A reward function takes `(prompts, completions, **metadata)` — lists of strings and, per
metadata field of the data rows (e.g. `answer`), a list of values — and returns one float
per completion. Several functions combine as a weighted sum.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from gpurl.config import ConfigError
from gpurl.rewards.builtin import BUILTIN

RewardFn = Callable[..., Sequence[float]]


class RewardError(RuntimeError):
    """A reward function raised or returned the wrong shape; the message names it and the row."""


def resolve(name: str) -> RewardFn:
    """A built-in reward by name, or a user function written as "pkg.module:function"."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"reward {name!r} is neither built in ({', '.join(BUILTIN)}) nor "
                          f"written as 'pkg.module:function'; fix the name.")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"reward {name!r} could not be imported ({e}); make the module "
                          f"importable (e.g. on PYTHONPATH) and check the function name.") from None
    if not callable(fn):
        raise ConfigError(f"reward {name!r} is not callable; point it at a function.")
    return fn


@dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    weight: float = 1.0


def load(names: Sequence[str], weights: Sequence[float] | None = None) -> list[Reward]:
    weights = list(weights) if weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise ConfigError(f"{len(names)} reward functions but {len(weights)} reward weights; "
                          f"give one weight per function.")
    return [Reward(n, resolve(n), float(w)) for n, w in zip(names, weights)]


def score(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str],
          metadata: dict[str, Sequence[Any]], first_row: int = 0) -> tuple[np.ndarray, dict]:
    """(weighted total per completion, {name: per-function scores}); a function that raises
    or returns the wrong number of floats stops with its name and the global row."""
    total = np.zeros(len(completions), np.float64)
    parts = {}
    for reward in rewards:
        try:
            values = np.asarray(reward.fn(list(prompts), list(completions), **metadata), np.float64)
        except Exception as e:  # noqa: BLE001 - a user's function may raise anything
            row = _failing_row(reward, prompts, completions, metadata)
            where = f" on row {first_row + row}" if row is not None else ""
            raise RewardError(f"reward function {reward.name!r} raised {type(e).__name__}: {e}"
                               f"{where}; fix the function or the data.") from e
        if values.shape != (len(completions),):
            raise RewardError(f"reward function {reward.name!r} returned {values.size} values "
                               f"for {len(completions)} completions; return one float each.")
        parts[reward.name] = values
        total += reward.weight * values
    return total, parts


def _failing_row(reward: Reward, prompts, completions, metadata) -> int | None:
    """Re-runs one row at a time to name the row that makes the function raise."""
    for i in range(len(completions)):
        try:
            reward.fn([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in metadata.items()})
        except Exception:  # noqa: BLE001
            return i
    return None

"""Reward functions: built-ins by name and user functions by "pkg.module:function".

A reward function takes `(prompts, completions, **metadata)` — lists of strings and, per
metadata field of the data rows (e.g. `answer`), a list of values — and returns one float
per completion. Several functions combine as a weighted sum.

A function that raises, returns the wrong number of values or runs past its timeout
either stops the run (`rewards.on_error=stop`: `RewardError` naming it and the row) or
scores the rows it failed on 0 (`zero`; they are counted). User functions are imported
and timed by `gpurl.user_code` (a hung call keeps its daemon thread until it returns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from gpurl.config import ConfigError, RewardsConfig
from gpurl.rewards.builtin import BUILTIN
from gpurl.user_code import Timeout, call_with_timeout, import_object

RewardFn = Callable[..., Sequence[float]]


class RewardError(RuntimeError):
    """A reward function raised or returned the wrong shape; the message names it and the row."""


def resolve(name: str) -> RewardFn:
    """A built-in reward by name, or a user function written as "pkg.module:function"."""
    if name in BUILTIN:
        return BUILTIN[name]
    fn = import_object(name, f"reward {name!r}", f"built in ({', '.join(BUILTIN)})")
    if not callable(fn):
        raise ConfigError(f"reward {name!r} is not callable; point it at a function.")
    return fn


ON_ERROR = ("stop", "zero")


@dataclass(frozen=True)
class Reward:
    name: str
    fn: RewardFn
    weight: float = 1.0
    on_error: str = "stop"  # stop: raise RewardError; zero: score the failing rows 0
    timeout_s: float = 0.0  # seconds one call may take; 0 = no limit


def load(names: Sequence[str], weights: Sequence[float] | None = None, on_error: str = "stop",
         timeout_s: float = 60.0) -> list[Reward]:
    """The functions `names`, with a failure policy (the defaults are `RewardsConfig`'s)."""
    weights = list(weights) if weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise ConfigError(f"{len(names)} reward functions but {len(weights)} reward weights; "
                          f"give one weight per function.")
    if on_error not in ON_ERROR:
        raise ConfigError(f"rewards.on_error={on_error!r} is not valid; use one of: "
                          f"{', '.join(ON_ERROR)}.")
    return [Reward(n, resolve(n), float(w), on_error, float(timeout_s))
            for n, w in zip(names, weights)]


def from_config(cfg: RewardsConfig, default: Sequence[str]) -> list[Reward]:
    """The functions `cfg` names (`default`, the data's, when it names none), with its
    weights and failure policy: the one way train, eval and task evaluation load rewards."""
    return load(list(cfg.functions) or list(default), cfg.weights or None, cfg.on_error,
                cfg.timeout_s)


class Scores(NamedTuple):
    total: np.ndarray  # weighted sum per completion
    parts: dict[str, np.ndarray]  # each function's scores, by name
    errors: np.ndarray  # bool per completion: a function failed on it (rewards.on_error=zero)


def score(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str],
          metadata: dict[str, Sequence[Any]], first_row: int = 0) -> tuple[np.ndarray, dict]:
    """(weighted total per completion, {name: per-function scores}); see `score_rows`."""
    scores = score_rows(rewards, prompts, completions, metadata, first_row)
    return scores.total, scores.parts


def score_rows(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str],
               metadata: dict[str, Sequence[Any]], first_row: int = 0) -> Scores:
    """Every function's scores and their weighted sum. A function that raises, returns the
    wrong number of floats or times out stops with its name and the global row (or, with
    on_error="zero", scores the rows it failed on 0 and marks them in `errors`)."""
    total = np.zeros(len(completions), np.float64)
    errors = np.zeros(len(completions), bool)
    parts = {}
    args = (list(prompts), list(completions), metadata)
    for reward in rewards:
        values, failed = _score_one(reward, *args, first_row)
        parts[reward.name] = values
        total += reward.weight * values
        errors |= failed
    return Scores(total, parts, errors)


class _WrongShape(Exception):
    def __init__(self, size: int):
        super().__init__(size)
        self.size = size


def _call(reward: Reward, prompts: list[str], completions: list[str],
          metadata: dict[str, Sequence[Any]]) -> np.ndarray:
    """The function's scores as float64: raises what it raises, `Timeout` when it runs past
    `reward.timeout_s`, or `_WrongShape`."""
    def run() -> np.ndarray:
        return np.asarray(reward.fn(prompts, completions, **metadata), np.float64)

    values = call_with_timeout(run, reward.timeout_s, f"reward {reward.name}")
    if values.shape != (len(completions),):
        raise _WrongShape(values.size)
    return values


def _score_one(reward: Reward, prompts: list[str], completions: list[str],
               metadata: dict[str, Sequence[Any]], first_row: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, failed rows) of one function over the batch."""
    n = len(completions)
    try:
        return _call(reward, prompts, completions, metadata), np.zeros(n, bool)
    except Timeout:
        if reward.on_error == "zero":
            return np.zeros(n), np.ones(n, bool)  # rows one by one could wait n timeouts
        raise RewardError(
            f"reward function {reward.name!r} did not return within rewards.timeout_s="
            f"{reward.timeout_s:g} s on rows {first_row}..{first_row + n - 1}; fix the function, "
            f"raise rewards.timeout_s, or set rewards.on_error=zero to score such rows 0.") from None
    except _WrongShape as e:
        if reward.on_error == "zero":
            return np.zeros(n), np.ones(n, bool)
        raise RewardError(f"reward function {reward.name!r} returned {e.size} values "
                          f"for {n} completions; return one float each.") from None
    except Exception as e:  # noqa: BLE001 - a user's function may raise anything
        if reward.on_error == "zero":
            return _row_by_row(reward, prompts, completions, metadata)
        row = _failing_row(reward, prompts, completions, metadata)
        where = f" on row {first_row + row}" if row is not None else ""
        raise RewardError(f"reward function {reward.name!r} raised {type(e).__name__}: {e}"
                          f"{where}; fix the function or the data (or set rewards.on_error=zero "
                          f"to score such rows 0).") from e


def _one_row(i: int, prompts, completions, metadata) -> tuple:
    return [prompts[i]], [completions[i]], {k: [v[i]] for k, v in metadata.items()}


def _row_by_row(reward: Reward, prompts, completions, metadata) -> tuple[np.ndarray, np.ndarray]:
    """Scores each row alone; rows it fails on score 0. After one timeout the remaining rows
    are not tried (each could wait a full timeout)."""
    values, failed = np.zeros(len(completions)), np.ones(len(completions), bool)
    for i in range(len(completions)):
        try:
            values[i] = _call(reward, *_one_row(i, prompts, completions, metadata))[0]
            failed[i] = False
        except Timeout:
            break
        except Exception:  # noqa: BLE001
            continue
    return values, failed


def _failing_row(reward: Reward, prompts, completions, metadata) -> int | None:
    """Re-runs one row at a time to name the row that makes the function raise."""
    for i in range(len(completions)):
        try:
            _call(reward, *_one_row(i, prompts, completions, metadata))
        except _WrongShape:
            continue
        except Exception:  # noqa: BLE001 - Timeout included: that row hangs
            return i
    return None

"""The environment protocol, safe calls into user code, and loading by name."""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable, NamedTuple, TypeVar, Union

from gpurl.config import ConfigError

# What an environment answers: text appended as it is, or chat messages (e.g. a "tool"
# message) rendered through the tokenizer's chat template; None or "" appends nothing.
Observation = Union[str, list, None]


class Step(NamedTuple):
    observation: Observation = None
    reward: float = 0.0
    done: bool = False


class Environment:
    """One trajectory's environment, built from its data row: `Name(prompt, **metadata)`
    (metadata: the row's other fields, e.g. `answer`). Subclasses override `step`, and
    `reset` when the environment speaks before the model's first turn."""

    def __init__(self, prompt: Any, **metadata: Any):
        self.prompt, self.metadata = prompt, metadata

    def reset(self) -> Observation:
        """An observation appended after the prompt before the first turn (None: none)."""
        return None

    def step(self, action: str) -> Step:
        """The reply to one model turn (`action`: its text, cut at the turn's stop string)."""
        raise NotImplementedError(f"{type(self).__name__} does not define step(action)")


class EnvError(RuntimeError):
    """An environment or tool raised or ran past its time limit (env.on_error=stop); the
    message names it and the row."""


class Timeout(Exception):
    pass


_T = TypeVar("_T")


def call_with_timeout(fn: Callable[[], _T], timeout_s: float, name: str) -> _T:
    """`fn()`, raising what it raises, or `Timeout` after `timeout_s` seconds (0 = no
    limit). The call runs in a daemon thread; Python cannot kill a thread, so a hung call
    keeps its thread until it returns or the process exits."""
    if timeout_s <= 0:
        return fn()
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = e

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Timeout()
    if "error" in out:
        raise out["error"]
    return out["value"]


def import_object(name: str, what: str, key: str) -> Any:
    """The object a "pkg.module:attr" name points at, or one sentence saying why not."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}={name!r} is neither a built-in {what} nor written as "
                          f"'pkg.module:Name'; fix the name.")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}={name!r} could not be imported ({e}); make the module "
                          f"importable (e.g. on PYTHONPATH) and check the name.") from None

"""Calls into user code: the object a "pkg.module:attr" name points at (reward functions,
environments, tools), and a call under a time limit. Rewards and environments load and
time their user code here, and nothing else in gpurl imports a module by a name from the
config.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable, TypeVar

from gpurl.config import ConfigError

_T = TypeVar("_T")


class Timeout(Exception):
    """A call ran past its time limit (`call_with_timeout`)."""


def call_with_timeout(fn: Callable[[], _T], timeout_s: float, name: str) -> _T:
    """`fn()`, raising what it raises, or `Timeout` after `timeout_s` seconds (0 = no
    limit). The call runs in a daemon thread named `name`; Python cannot kill a thread, so
    a hung call keeps its thread (and whatever it holds) until it returns or the process
    exits."""
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


def import_object(name: str, label: str, builtin: str) -> Any:
    """The object "pkg.module:attr" names, or one sentence saying why not. `label` names
    the setting in the message (`env.name='x'`), `builtin` says what else it could have
    been ("a built-in environment (calculator, ...)")."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{label} is neither {builtin} nor written as 'pkg.module:Name'; "
                          f"fix the name.")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{label} could not be imported ({e}); make the module importable "
                          f"(its folder on PYTHONPATH) and check the name.") from None

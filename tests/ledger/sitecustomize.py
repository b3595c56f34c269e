"""The suite's ledger of processes and compiles (tests/suite_budget.py reads it).

Python imports this module at the start of every process whose PYTHONPATH holds this folder
(tests/conftest.py puts it there, so every process a test starts inherits it, and the
processes those start). With GPURL_TEST_LEDGER set, it appends one line for the process
when it starts, and one when it ends with the programs JAX compiled or loaded from the
persistent cache in it, each under the test that was running (GPURL_TEST_NODE). A process
killed with SIGKILL leaves its start line only. Nothing here changes what the process does.
"""

from __future__ import annotations

import os

_LEDGER = os.environ.get("GPURL_TEST_LEDGER")


def append(path: str, record: dict) -> None:
    import json

    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write under O_APPEND: lines from many processes never mix
    finally:
        os.close(fd)


class Counts:
    """Programs that reached XLA (compiled or loaded from the persistent cache), how many
    came from the cache, and the seconds they took; counted by JAX's monitoring events."""

    def __init__(self) -> None:
        self.programs, self.cached, self.seconds = 0, 0, 0.0

    def listen(self, monitoring) -> None:
        monitoring.register_event_listener(self._event)
        monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.cached += 1

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.programs += 1
            self.seconds += seconds


def _after_import(name: str, then) -> None:
    """Calls `then(module)` right after `name` is first imported (if it ever is)."""
    import importlib.abc
    import importlib.util
    import sys

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                then(module)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def _start(path: str) -> None:
    import atexit
    import sys

    test = os.environ.get("GPURL_TEST_NODE", "")
    append(path, {"test": test, "pid": os.getpid(), "start": " ".join(sys.argv[:2])[:200]})
    counts = Counts()
    _after_import("jax._src.monitoring", counts.listen)
    atexit.register(lambda: append(path, {"test": test, "pid": os.getpid(), "programs": counts.programs,
                                           "cached": counts.cached, "compile_s": round(counts.seconds, 3)}))


if _LEDGER and __name__ == "sitecustomize":  # (tests/suite_budget.py imports it by path)
    try:
        _start(_LEDGER)
    except Exception as e:  # the ledger must never stop a process of the suite
        import sys

        print(f"tests/ledger/sitecustomize.py: not recording this process: {e!r}", file=sys.stderr)

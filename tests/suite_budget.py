"""The suite's time and its budget (a pytest plugin, loaded by tests/conftest.py).

At the end of every run: the slowest 25 tests (pytest's --durations, pyproject.toml) and a
table of each tier's tests, seconds, the processes its tests started (every Python process,
however deep: tests/ledger/sitecustomize.py records them) and the programs JAX compiled or
loaded in its test processes and in those processes, with the share the persistent cache
served. The processes and programs of a tier may not pass their ceilings in
tests/budget.json: a run over a ceiling fails, naming the tier and the count. They are
counts, not times, so the check holds on a slow machine as on a fast one; raise a ceiling
in the commit that needs it, with the reason in its message (tests/README.md gives the rule).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pytest

# The tiers by marker, in the order that names a test with several markers; "unit" has none
# (Makefile's FAST_TIER runs it).
TIERS = ("multiprocess", "slurm", "realmodel", "cuda_lowering", "index", "gpu", "e2e", "slow")
BUDGET = Path(__file__).with_name("budget.json")
LEDGER_DIR = Path(__file__).with_name("ledger")


def tier_of(keywords: Iterable[str]) -> str:
    names = set(keywords)
    return next((t for t in TIERS if t in names), "unit")


def canonical(config: pytest.Config) -> bool:
    """Whether this run is `make test` (every test) or `make test-fast` (the unit tier):
    the runs whose counts the ceilings hold. A tier's compile count depends on what ran
    before it in each worker (a program compiled once serves every later test), so a
    selection of tests counts differently; the unit tier's ceiling holds both runs."""
    opt = config.option
    if opt.keyword or opt.deselect or any(a not in ("tests", "tests/") for a in config.args):
        return False
    expr = " ".join(opt.markexpr.split())
    return not expr or _same_tiers(expr)


def _same_tiers(expr: str) -> bool:
    """`not (a or b ...)` naming exactly the tiers, in any order (the Makefile's FAST_TIER)."""
    if not (expr.startswith("not (") and expr.endswith(")")):
        return False
    return set(expr[5:-1].split(" or ")) == set(TIERS)


def _ledger_module() -> Any:
    spec = importlib.util.spec_from_file_location("gpurl_test_ledger", LEDGER_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_ledger() -> None:
    """Every process of the session (the pytest workers inherit this from the first
    process) appends to one ledger file, and every Python process loads the recorder."""
    if "GPURL_TEST_LEDGER" not in os.environ:
        folder = tempfile.mkdtemp(prefix="gpurl-test-ledger-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        os.environ["GPURL_TEST_LEDGER"] = os.path.join(folder, "ledger.jsonl")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(LEDGER_DIR) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(LEDGER_DIR), *filter(None, paths)])


@dataclass
class Tier:
    tests: int = 0
    seconds: float = 0.0
    processes: int = 0
    programs: int = 0
    cached: int = 0
    compile_s: float = 0.0


@dataclass
class Ledger:
    """What the session's processes recorded, by test."""
    starts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    programs: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0.0]))

    @classmethod
    def read(cls, path: Path) -> "Ledger":
        ledger = cls()
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            record = json.loads(line)
            test = record["test"]
            if not test:  # the pytest workers themselves, outside any test
                continue
            if "start" in record:
                ledger.starts[test] += 1
            else:
                counts = ledger.programs[test]
                counts[0] += record["programs"]
                counts[1] += record["cached"]
                counts[2] += record["compile_s"]
        return ledger


def tally(tests: dict[str, tuple[str, float]], ledger: Ledger) -> dict[str, Tier]:
    """Each tier's figures: `tests` maps a test id to its tier and seconds."""
    tiers: dict[str, Tier] = {}
    for test, (tier, seconds) in tests.items():
        t = tiers.setdefault(tier, Tier())
        t.tests += 1
        t.seconds += seconds
        t.processes += ledger.starts.get(test, 0)
        programs, cached, compile_s = ledger.programs.get(test, (0, 0, 0.0))
        t.programs += programs
        t.cached += cached
        t.compile_s += compile_s
    return tiers


def over_budget(tiers: dict[str, Tier], ceilings: dict[str, dict[str, int]]) -> list[str]:
    """One sentence for each count that passed its ceiling."""
    problems = []
    for name, t in sorted(tiers.items()):
        for what in ("processes", "programs"):
            limit = ceilings.get(name, {}).get(what)
            got = getattr(t, what)
            if limit is None:
                problems.append(f"the {name} tier has no {what} ceiling in tests/budget.json; add one.")
            elif got > limit:
                problems.append(
                    f"the {name} tier's tests {'started' if what == 'processes' else 'compiled'} "
                    f"{got} {'processes' if what == 'processes' else 'programs'}, over its ceiling "
                    f"of {limit} in tests/budget.json: share a run directory, a process or a "
                    f"compiled program with another test (tests/README.md), or raise the "
                    f"ceiling in the commit that needs it.")
    return problems


def table(tiers: dict[str, Tier]) -> list[str]:
    order = ["unit", *TIERS]
    rows = ["| tier | tests | seconds | processes | programs | from the cache | compile s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    total = Tier()
    for name in sorted(tiers, key=order.index):
        t = tiers[name]
        for key in vars(total):
            setattr(total, key, getattr(total, key) + getattr(t, key))
        rows.append(_row(name, t))
    rows.append(_row("all", total))
    return rows


def _row(name: str, t: Tier) -> str:
    share = f"{t.cached / t.programs:.0%}" if t.programs else "-"
    return (f"| {name} | {t.tests} | {t.seconds:.0f} | {t.processes} | {t.programs} | {share} | "
            f"{t.compile_s:.0f} |")


class BudgetPlugin:
    """In a test process: the test's id for the processes it starts, and the programs it
    compiles, in the ledger. In the controlling process: the table and the check."""

    def __init__(self, config: pytest.Config):
        self.worker = hasattr(config, "workerinput")
        self.checked = canonical(config)
        self.tests: dict[str, tuple[str, float]] = {}
        self.problems: list[str] = []
        self.tiers: dict[str, Tier] = {}
        self.ledger = _ledger_module()
        self.counts = self.ledger.Counts()
        import jax.monitoring

        self.counts.listen(jax.monitoring)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Any:
        os.environ["GPURL_TEST_NODE"] = item.nodeid
        before = (self.counts.programs, self.counts.cached, self.counts.seconds)
        try:
            yield
        finally:
            del os.environ["GPURL_TEST_NODE"]
            c = self.counts
            self.ledger.append(os.environ["GPURL_TEST_LEDGER"], {
                "test": item.nodeid, "programs": c.programs - before[0],
                "cached": c.cached - before[1], "compile_s": round(c.seconds - before[2], 3)})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.worker:
            return
        tier, seconds = self.tests.get(report.nodeid, (tier_of(report.keywords), 0.0))
        self.tests[report.nodeid] = (tier, seconds + report.duration)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.worker or not self.tests:
            return
        self.tiers = tally(self.tests, Ledger.read(Path(os.environ["GPURL_TEST_LEDGER"])))
        if not self.checked:
            return
        self.problems = over_budget(self.tiers, json.loads(BUDGET.read_text())["tiers"])
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(trylast=True)  # after pytest's slowest tests: the last thing printed
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.worker or not self.tiers:
            return
        terminalreporter.write_sep("=", "each tier's time, processes and programs (tests/budget.json)")
        for line in table(self.tiers):
            terminalreporter.write_line(line)
        for problem in self.problems:
            terminalreporter.write_line(f"suite budget: {problem}", red=True, bold=True)
        if not self.checked:
            terminalreporter.write_line("(the ceilings are checked on `make test` and `make "
                                        "test-fast`, not on a selection of tests)")

"""The suite's budget (tests/suite_budget.py): the ledger records the processes a test
starts and the programs they compile under that test, the tiers are the Makefile's, and a
tier over its ceiling in tests/budget.json is one sentence that fails the run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import suite_budget
from suite_budget import Ledger, Tier, canonical, over_budget, tally, tier_of

ROOT = Path(__file__).resolve().parents[1]


def test_a_process_a_test_starts_is_recorded_with_its_compiles_under_that_test(request):
    """A Python process started by a test, and one that process starts, each leave a start
    line and their programs under the test's id (the grandchild compiles two programs)."""
    code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
            "'import jax; f = jax.jit(lambda x: x + 1); f(1); f(1.0)'], check=True)")
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ)
    ledger = Ledger.read(Path(os.environ["GPURL_TEST_LEDGER"]))
    assert ledger.starts[request.node.nodeid] == 2
    assert ledger.programs[request.node.nodeid][0] == 2


def test_the_tiers_are_the_makefiles():
    """The unit tier is what `make test-fast` runs: no tier marker of tests/suite_budget.py,
    and every marker pyproject.toml declares is a tier."""
    fast = re.search(r"FAST_TIER := not \((.*)\)", (ROOT / "Makefile").read_text())[1]
    assert set(fast.split(" or ")) == set(suite_budget.TIERS)
    declared = re.findall(r'^  "(\w+):', (ROOT / "pyproject.toml").read_text(), re.M)
    assert set(declared) == set(suite_budget.TIERS)
    assert tier_of(["e2e", "slow"]) == "e2e" and tier_of(["parametrize"]) == "unit"


def test_a_tier_over_its_ceiling_fails_in_one_sentence(tmp_path):
    ledger_file = tmp_path / "ledger.jsonl"
    records = [{"test": "a", "pid": 1, "start": "gpurl train"},
               {"test": "a", "pid": 1, "programs": 30, "cached": 10, "compile_s": 3.0},
               {"test": "b", "programs": 5, "cached": 0, "compile_s": 0.5},
               {"test": "", "pid": 2, "start": "pytest worker"}]
    ledger_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    tiers = tally({"a": ("e2e", 4.0), "b": ("unit", 1.0)}, Ledger.read(ledger_file))
    assert tiers == {"e2e": Tier(1, 4.0, 1, 30, 10, 3.0), "unit": Tier(1, 1.0, 0, 5, 0, 0.5)}
    ceilings = {"e2e": {"processes": 1, "programs": 29}, "unit": {"processes": 0, "programs": 5}}
    problems = over_budget(tiers, ceilings)
    assert len(problems) == 1 and problems[0].startswith(
        "the e2e tier's tests compiled 30 programs, over its ceiling of 29 in tests/budget.json")
    assert "the unit tier has no processes ceiling in tests/budget.json; add one." in over_budget(
        tiers, {"e2e": ceilings["e2e"]})
    committed = json.loads((ROOT / "tests" / "budget.json").read_text())["tiers"]
    assert set(committed) == {"unit", *suite_budget.TIERS}


def test_the_ceilings_hold_make_test_and_make_test_fast_only():
    """A program compiled once serves every later test of its worker, so a selection of
    tests counts other programs than the full suite: only `make test` (no selection) and
    `make test-fast` (the Makefile's FAST_TIER expression) are held to the ceilings."""
    fast = re.search(r'FAST_TIER := (.*)', (ROOT / "Makefile").read_text())[1]

    def run(args=(), markexpr="", keyword="", deselect=None):
        return SimpleNamespace(args=list(args), option=SimpleNamespace(
            markexpr=markexpr, keyword=keyword, deselect=deselect))
    assert canonical(run()) and canonical(run(["tests"], fast))
    assert not canonical(run(["tests/test_ppo.py"])) and not canonical(run(markexpr="e2e"))
    assert not canonical(run(keyword="grpo")) and not canonical(run(deselect=["tests/x.py"]))

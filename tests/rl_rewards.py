"""Reward functions the multi-process tests import by path ("rl_rewards:printable_counted"
with tests/ on PYTHONPATH)."""

from __future__ import annotations

import os
from pathlib import Path


def printable_counted(prompts, completions, **_):
    """Share of printable ASCII characters; appends how many rows this process scored to
    $GPURL_TEST_COUNT_DIR/<pid> so a test can check every row is scored exactly once."""
    folder = os.environ.get("GPURL_TEST_COUNT_DIR")
    if folder:
        with (Path(folder) / str(os.getpid())).open("a") as f:
            f.write(f"{len(completions)}\n")
    return [sum(32 <= ord(c) < 127 for c in text) / max(len(text), 1) for text in completions]


def printable_on_odd_answers(prompts, completions, answer=(), **_):
    """1.0 for every completion of a row whose answer is an even number (a group with no
    signal: dynamic sampling drops it), else the share of printable characters."""
    shares = printable_counted(prompts, completions)
    return [1.0 if str(a).isdigit() and int(a) % 2 == 0 else s for a, s in zip(answer, shares)]

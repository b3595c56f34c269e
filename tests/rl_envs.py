"""Environments and tools the tests import by path ("rl_envs:CountedGuess" with tests/ on
PYTHONPATH)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from gpurl.envs import Environment, Step, ToolEnvironment
from gpurl.envs.builtin import GuessNumber
from gpurl.data.tasks import tool_call


class CountedGuess(GuessNumber):
    """Guess the number; every step appends "<trajectory id> <turn>" to
    $GPURL_TEST_COUNT_DIR/<pid>, so a test can check each environment is stepped exactly
    once per turn, by one process."""

    def __init__(self, prompt, **metadata):
        super().__init__(prompt, **metadata)
        self.id, self.turn = uuid.uuid4().hex, 0

    def step(self, action):
        self.turn += 1
        folder = os.environ.get("GPURL_TEST_COUNT_DIR")
        if folder:
            with (Path(folder) / str(os.getpid())).open("a") as f:
                f.write(f"{self.id} {self.turn}\n")
        return super().step(action)


def boom(expression: str) -> str:
    """Always raises."""
    raise RuntimeError("the tool broke")


def hang(expression: str) -> str:
    """Sleeps far past any test's env.timeout_s."""
    time.sleep(30)
    return "late"


class ScriptedCalls(ToolEnvironment):
    """Calls a tool on the first turn whatever the model wrote (a scripted model's tool
    call through the real parse / check / call path): rows with an even answer call the
    first configured tool, odd ones the calculator; the second turn ends with reward 1."""

    def step(self, action):
        if self.calls:
            return Step(None, 1.0, True)
        name = next(iter(self.tools)) if int(self.metadata["answer"]) % 2 == 0 else "calculator"
        return super().step(tool_call(name, expression="1 + 2"))


class PrintableGame(Environment):
    """Three turns, each scored by the share of printable ASCII in the model's text (so a
    tiny random model's rewards differ between rows); "More." after each of the first two."""

    def __init__(self, prompt, **metadata):
        super().__init__(prompt, **metadata)
        self.turn = 0

    def step(self, action):
        self.turn += 1
        reward = sum(32 <= ord(c) < 127 for c in action) / max(len(action), 1)
        return Step(None if self.turn >= 3 else " More.\n", reward, self.turn >= 3)

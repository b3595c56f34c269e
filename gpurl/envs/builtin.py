"""Built-in environments (`env=calculator`, `env=guess_number`, `env=tools`); their
prompts are the built-in tasks of the same names (`gpurl.data.tasks`)."""

from __future__ import annotations

import re
from typing import Any

from gpurl.config import ConfigError
from gpurl.envs.base import Environment, Step
from gpurl.user_code import import_object
from gpurl.envs.tools import ToolEnvironment

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ANSWER = re.compile(r"answer\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def _same_number(text: str | None, answer: Any) -> bool:
    try:
        return text is not None and abs(float(text) - float(answer)) < 1e-6
    except (TypeError, ValueError):
        return False


class Tools(ToolEnvironment):
    """Any tools (`env.tools`), no reward of its own: the reward functions
    (`rewards.functions`) score the final answer's text."""


class Calculator(ToolEnvironment):
    """Arithmetic word problems with a calculator tool: the model may call `calculator`
    as often as it likes, then writes `Answer: N`; reward 1 when N equals the row's
    `answer`, else 0."""

    default_tools = ("calculator",)

    def score(self, answer: str) -> float:
        found = _ANSWER.search(answer)
        return float(_same_number(found.group(1) if found else None, self.metadata.get("answer")))


class GuessNumber(Environment):
    """Guess the number: the model names a number each turn and hears "Higher." or
    "Lower." (then "Guess:", so its next turn is the number) until it is right (reward 1)
    or its turns run out (0). The row's `answer` is the number."""

    def step(self, action: str) -> Step:
        found = _NUMBER.search(action)
        if found is None:
            return Step("Say a number.\nGuess:")
        guess, target = float(found.group(0)), float(self.metadata["answer"])
        if guess == target:
            return Step(None, 1.0, True)
        return Step(("Higher." if guess < target else "Lower.") + "\nGuess:")


ENVIRONMENTS: dict[str, type] = {"calculator": Calculator, "guess_number": GuessNumber,
                                 "tools": Tools}


def resolve(name: str) -> type:
    """A built-in environment class by name, or a user class written as "pkg.module:Name"."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    cls = import_object(name, f"env.name={name!r}",
                        f"a built-in environment ({', '.join(ENVIRONMENTS)})")
    if not (isinstance(cls, type) and issubclass(cls, Environment)) and not (
            callable(cls) and hasattr(cls, "step")):
        raise ConfigError(f"env.name={name!r} is not an environment class; subclass "
                          f"gpurl.envs.Environment (or give a class with reset() and step(action)).")
    return cls

"""The environment protocol (its user code is loaded and timed by `gpurl.user_code`)."""

from __future__ import annotations

from typing import Any, NamedTuple, Union

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

"""Thinking traces and finished completions, as the scorers read them.

Reasoning models think inside `<think>...</think>` before they answer. Templates that open
the trace in the generation prompt (DeepSeek-R1-Distill, QwQ, Qwen3's thinking mode) leave
the completion with only the closing tag, so the prompt says whether a trace is open. A
completion is *finished* when it ended by itself (EOS, a stop id or a stop string, not the
token limit) with every thinking trace it was in closed: a trace cut at the limit may end in
a bare number that a lenient scorer would take for the answer ("I computed 18 but ran out
of" reads as 18). The scorer of a rollout passes each completion's `finished` to every
reward function (`gpurl.rollout.scoring`); the math reward and the suites' scorers score an
unfinished completion 0.
"""

from __future__ import annotations

from typing import Sequence

OPEN, CLOSE = "<think>", "</think>"


def left_open(text: str) -> bool:
    """Whether `text` opens a thinking trace it does not close (its last `<think>` comes
    after its last `</think>`): a rendered prompt that leaves the model thinking."""
    return text.rfind(OPEN) > text.rfind(CLOSE)


def finished(completion: str, ended: bool, opened: bool) -> bool:
    """Whether a completion is finished: it `ended` by itself, no trace of its own is left
    open, and a trace its prompt `opened` is closed in it."""
    return ended and not left_open(completion) and not (opened and CLOSE not in completion)


def final_text(completion: str) -> str | None:
    """What the model answers: the text after the last `</think>` (a template that opens
    the trace in the prompt leaves only the closing tag in the completion), the whole text
    without a trace, None when a `<think>` is never closed (no answer was given)."""
    _, closed, after = completion.rpartition(CLOSE)
    if closed:
        return after
    return None if OPEN in completion else completion


def unfinished_zero(scores: Sequence[float], finished: Sequence[bool] | None) -> list[float]:
    """`scores` with every unfinished completion's set to 0 (`finished` None: all finished,
    as when a scorer is called outside a rollout)."""
    if finished is None:
        return list(scores)
    return [s if done else 0.0 for s, done in zip(scores, finished)]

"""Built-in reward functions (each `(prompts, completions, **metadata) -> list[float]`)."""

from __future__ import annotations

import re
from typing import Any, Sequence

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_HASHES = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract_answer(text: str, mode: str = "auto") -> str | None:
    """The answer a completion gives: `\\boxed{...}` (MATH), then `#### x` (GSM8K), then the
    last number (`auto`); `first` takes the first number (answer-first few-shot formats)."""
    if mode == "first":
        match = _NUMBER.search(text)
        return match.group(0) if match else None
    for pattern in (_BOXED, _HASHES):
        found = pattern.findall(text)
        if found:
            return found[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def _matches(completion: str, answer: Any, mode: str) -> float:
    got, want = _as_number(extract_answer(completion, mode)), _as_number(str(answer))
    return float(got is not None and want is not None and abs(got - want) < 1e-6)


def numeric_match(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any],
                  **_: Any) -> list[float]:
    """1.0 when the completion's answer (boxed, ####, else last number) equals `answer`."""
    return [_matches(c, a, "auto") for c, a in zip(completions, answer)]


def first_number_match(prompts: Sequence[str], completions: Sequence[str],
                       answer: Sequence[Any], **_: Any) -> list[float]:
    """1.0 when the first number of the completion equals `answer` (few-shot line formats)."""
    return [_matches(c, a, "first") for c, a in zip(completions, answer)]


def boxed_format(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """1.0 when the completion puts an answer in \\boxed{...}."""
    return [float(bool(_BOXED.search(c))) for c in completions]


def length_penalty(prompts: Sequence[str], completions: Sequence[str], **_: Any) -> list[float]:
    """-len(completion) / 1000: a mild push towards short answers (characters, not tokens)."""
    return [-len(c) / 1000.0 for c in completions]


BUILTIN = {"numeric_match": numeric_match, "first_number_match": first_number_match,
           "boxed_format": boxed_format, "length_penalty": length_penalty}

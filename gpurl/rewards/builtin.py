"""Built-in reward functions (each `(prompts, completions, **metadata) -> list[float]`)."""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from fractions import Fraction
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


_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
               ast.Div: operator.truediv}
_MAX_EXPRESSION_CHARS = 200  # longer lines score 0 before parsing: deep nesting costs memory


def countdown(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any],
              numbers: Sequence[Sequence[int]], **_: Any) -> list[float]:
    """1.0 when the completion's first line is an expression equal to `answer` that uses
    only `numbers`, each at most once, with + - * / and parentheses (no unary minus).

    A trailing "= <answer>" is allowed. The line is parsed with `ast` and folded over exact
    fractions: nothing in it is ever executed.
    """
    return [_countdown_score(c, a, n) for c, a, n in zip(completions, answer, numbers)]


def _countdown_score(completion: str, target: Any, numbers: Sequence[int]) -> float:
    expression, equals, claimed = completion.split("\n", 1)[0].partition("=")
    used: list[int] = []
    value = _fold_expression(expression, used)
    want = _as_number(str(target))
    overused = Counter(used) - Counter(int(n) for n in numbers)  # numbers not given, or reused
    if value is None or want is None or overused:
        return 0.0
    if equals and _as_number(claimed) != want:
        return 0.0
    return float(value == Fraction(want))


def _fold_expression(text: str, used: list[int]) -> Fraction | None:
    """The exact value of an arithmetic expression over integers (appended to `used`);
    None for anything else, division by zero included."""
    if len(text) > _MAX_EXPRESSION_CHARS:
        return None
    try:
        return _fold(ast.parse(text.strip(), mode="eval").body, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None


def _fold(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        return _ARITHMETIC[type(node.op)](_fold(node.left, used), _fold(node.right, used))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError(f"{type(node).__name__} is not allowed in a countdown expression")


BUILTIN = {"numeric_match": numeric_match, "first_number_match": first_number_match,
           "boxed_format": boxed_format, "length_penalty": length_penalty,
           "countdown": countdown}

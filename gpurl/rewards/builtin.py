"""Built-in reward functions (each `(prompts, completions, **metadata) -> list[float]`)."""

from __future__ import annotations

import ast
import math
import numbers
import operator
import re
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from typing import Any, Callable, Sequence

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


def first_line_match(prompts: Sequence[str], completions: Sequence[str],
                     answer: Sequence[Any], **_: Any) -> list[float]:
    """1.0 when the completion's first line, stripped and lower-cased, equals `answer`
    (short text answers: the `quadrant` task's "top left")."""
    return [float(c.strip().split("\n")[0].strip().lower() == str(a).strip().lower())
            for c, a in zip(completions, answer)]


_HASHES_LINE = re.compile(r"####[ \t]*(\S[^\n]*)")
_MAX_ANSWER_DIGITS = 100_000  # a reading holding a bigger number is dropped (see _log10_bound)
_LOG10_2 = math.log10(2)
_HUGE_FUNCTIONS = ("factorial", "factorial2", "subfactorial", "binomial", "gamma",
                   "RisingFactorial", "FallingFactorial")


def math_verify(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any],
                finished: Sequence[bool] | None = None, **_: Any) -> list[float]:
    """1.0 when the completion's final answer equals `answer` as mathematics, judged by
    Hugging Face's math-verify: `\\boxed{}` first, LaTeX or plain text, fractions against
    decimals, radicals, sets and intervals, with units and thousands separators dropped.

    Without a `\\boxed{}`, the rest of the last `#### x` line (GSM8K) is the answer: alone,
    math-verify would read the last number of the text after it. An unfinished completion
    (cut at the token limit, or left thinking: `gpurl.rewards.thinking`) scores 0, whatever
    number it ends on.
    """
    parse, verify = _math_verify_api()
    golds = [_gold_latex(a) for a in answer]
    readings = {g: _parse(parse, g) for g in set(golds)}  # a prompt's G completions share one
    done = [True] * len(completions) if finished is None else list(finished)
    return [float(ok and verify(readings[g], _parse(parse, _final_answer_text(c)),
                                timeout_seconds=None))
            for c, g, ok in zip(completions, golds, done)]


def _math_verify_api() -> tuple[Callable, Callable]:
    """math-verify's (parse, verify), imported on first use: it loads sympy (about 0.5 s)."""
    try:
        from math_verify import grader, parse, parser, verify
    except ImportError:
        raise ImportError("the math_verify reward needs the math-verify package; install it "
                          "with `pip install math-verify`.") from None
    # Its timeouts are off on purpose (`_parse`); gpurl bounds the work itself
    # (rewards.timeout_s, `_log10_bound`), so its two warnings that they are off (one from
    # parsing, one from comparing, each printed once per process) say nothing to a user.
    parser.TIMEOUT_WARNING_SHOWN = grader.TIMEOUT_WARNING_SHOWN = True
    return parse, verify


def _gold_latex(answer: Any) -> str:
    """`answer` as math-verify should read it: in `$...$`, without which it finds no
    `\\frac12`, `\\sqrt{8}` or `[1,2)`, and floats written out (`1e-07` reads as e - 7)."""
    if answer is None:
        return ""
    if isinstance(answer, numbers.Real) and not isinstance(answer, numbers.Rational):
        answer = f"{Decimal(str(answer)):f}"
    text = str(answer).strip()
    return text if not text or "$" in text or "\\boxed" in text else f"${text}$"


def _final_answer_text(completion: str) -> str:
    """What math-verify reads: the rest of the last `#### x` line when nothing is boxed."""
    found = None if "\\boxed" in completion else _HASHES_LINE.findall(completion)
    return found[-1] if found else completion


def _parse(parse: Callable, text: str) -> list:
    """math-verify's readings of `text` that are safe to evaluate. Its own timeout is off
    (`parsing_timeout=None`; `verify`'s `timeout_seconds=None`): it uses SIGALRM, which only
    the main thread may set, and `rewards.timeout_s` runs reward functions in a worker thread."""
    return [x for x in parse(text, parsing_timeout=None)
            if _log10_bound(x) <= _MAX_ANSWER_DIGITS]


def _log10_bound(expr: Any) -> float:
    """An upper bound on the decimal digits of the numbers that evaluating `expr` builds.

    `verify` evaluates both sides, and sympy computes `9^{9^{9}}` (370 million digits) in one
    C call that holds the GIL: no timeout, neither SIGALRM nor `rewards.timeout_s`'s thread,
    can stop it, and the whole process hangs. Strings (math-verify's raw readings) are 0.
    """
    import sympy

    huge = tuple(getattr(sympy, name) for name in _HUGE_FUNCTIONS)

    def bound(x: Any) -> float:
        if isinstance(x, sympy.MatrixBase):
            return max((bound(e) for e in x), default=0.0)
        if not isinstance(x, sympy.Basic):
            return 0.0
        if x.is_Number:
            return _number_log10(x)
        args = [bound(a) for a in x.args]
        if not args:
            return 1.0  # symbols and constants (pi, e, i)
        if x.is_Pow:  # b^e has at most 10^E * B digits, for b of B digits and e of E
            return math.inf if args[1] > 300 else 10.0 ** args[1] * max(args[0], 1.0)
        if isinstance(x, huge):  # n! has at most n * log10(n) digits
            return math.inf if max(args) > 300 else 10.0 ** max(args) * max(max(args), 1.0)
        if x.is_Mul:
            return sum(args)
        return max(args) + math.log10(len(args))  # sums; other functions keep their size

    try:
        return bound(expr)
    except RecursionError:
        return math.inf


def _number_log10(x: Any) -> float:
    """log10 of max(|x|, 1) for a sympy number, computed without evaluating anything big."""
    if not x.is_finite:
        return 0.0
    if x.is_Rational:
        return max(abs(x.p).bit_length() - x.q.bit_length() + 1, 0) * _LOG10_2
    return math.log10(max(abs(float(x)), 1.0))


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
           "first_line_match": first_line_match,
           "math_verify": math_verify, "boxed_format": boxed_format,
           "length_penalty": length_penalty, "countdown": countdown}

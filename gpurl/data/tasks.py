"""Built-in generated tasks with verifiable answers.

Each task is `fn(num, seed, cfg) -> [{"prompt", "completion", "answer", ...}, ...]`:
deterministic in `seed`, prefix-stable in `num` (a larger `num` extends the list rather than
changing it), and shaped by its own fields of `cfg` (a DataConfig).
"""

from __future__ import annotations

import json
from typing import Callable, NamedTuple

import numpy as np

from gpurl.config import ConfigError, DataConfig

# Canonical operator order: the default ops ("+", "-") enumerate problems exactly as the
# original fixed task did, whatever order a config lists them in.
_OPS = ("+", "-", "*")
_MAX_PROBLEMS = 10_000_000  # enumerating more (a, b) pairs than this would exhaust memory


def _arithmetic_space(cfg: DataConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All distinct (a, b, op) problems, op indexing _OPS; a - b only when a >= b."""
    (a_lo, a_hi), (b_lo, b_hi) = cfg.a_range, cfg.b_range
    if (a_hi - a_lo + 1) * (b_hi - b_lo + 1) > _MAX_PROBLEMS:
        raise ConfigError(f"data.a_range={list(cfg.a_range)} and data.b_range="
                          f"{list(cfg.b_range)} give over {_MAX_PROBLEMS:,} operand pairs; "
                          f"narrow the ranges.")
    a_grid, b_grid = np.meshgrid(np.arange(a_lo, a_hi + 1), np.arange(b_lo, b_hi + 1), indexing="ij")
    a_grid, b_grid = a_grid.reshape(-1), b_grid.reshape(-1)
    every = np.ones(a_grid.size, bool)
    keep = {"+": every, "-": a_grid >= b_grid, "*": every}
    chosen = [(i, keep[op]) for i, op in enumerate(_OPS) if op in cfg.ops]
    a_all = np.concatenate([a_grid[keep_grid] for _, keep_grid in chosen])
    b_all = np.concatenate([b_grid[keep_grid] for _, keep_grid in chosen])
    op_all = np.concatenate([np.full(int(keep_grid.sum()), i) for i, keep_grid in chosen])
    if not a_all.size:
        raise ConfigError(f"data.ops={list(cfg.ops)} with data.a_range={list(cfg.a_range)} and "
                          f"data.b_range={list(cfg.b_range)} gives no problem (a - b needs "
                          f"a >= b); widen the ranges or add + to data.ops.")
    return a_all, b_all, op_all


def arithmetic(num: int, seed: int, cfg: DataConfig = DataConfig()) -> list[dict]:
    """`num` items like {"prompt": "12 + 7 =", "completion": " 19", "answer": "19"}.

    Operands come from `cfg.a_range` and `cfg.b_range`, operators from `cfg.ops`. The first
    items, as many as there are distinct problems (15,050 by default), are unique; beyond
    that items repeat.
    """
    a_all, b_all, op_all = _arithmetic_space(cfg)
    rng = np.random.default_rng(seed)
    pick_X = rng.permutation(a_all.size)[:num]
    if num > a_all.size:
        pick_X = np.concatenate([pick_X, rng.integers(0, a_all.size, num - a_all.size)])
    a_X, b_X, op_X = a_all[pick_X], b_all[pick_X], op_all[pick_X]
    result_X = np.choose(op_X, [a_X + b_X, a_X - b_X, a_X * b_X])
    return [
        {"prompt": f"{a} {_OPS[op]} {b} =", "completion": f" {r}", "answer": str(r)}
        for a, b, op, r in zip(a_X.tolist(), b_X.tolist(), op_X.tolist(), result_X.tolist())
    ]


def arithmetic_prefs(num: int, seed: int, cfg: DataConfig = DataConfig()) -> list[dict]:
    """The `arithmetic` items as preference pairs: "chosen" is the correct completion, and
    "rejected" a plausible wrong answer, off by 1 to 10 either way (10 is the dropped carry
    of two-digit + one-digit addition), never negative: {"prompt": "27 + 5 =",
    "completion": " 32", "answer": "32", "chosen": " 32", "rejected": " 29"}.

    The offsets come from a stream of their own (prefix-stable in `num` like the items), so
    the problems and the split equal those of `arithmetic` with the same seed."""
    items = arithmetic(num, seed, cfg)
    draw_X = np.random.default_rng([seed, 2]).integers(0, 20, num)
    offset_X = np.where(draw_X < 10, -(draw_X + 1), draw_X - 9)
    pairs = []
    for item, offset in zip(items, offset_X.tolist()):
        right = int(item["answer"])
        wrong = right + offset if right + offset >= 0 else right - offset
        pairs.append({**item, "chosen": item["completion"], "rejected": f" {wrong}"})
    return pairs


class _Expr(NamedTuple):
    text: str
    value: int
    precedence: int  # 1: + -, 2: * /, 3: a number


_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _combine(left: _Expr, op: str, right: _Expr) -> _Expr:
    """`left op right` with only the parentheses the arithmetic needs."""
    p = _PRECEDENCE[op]
    left_text = left.text if left.precedence >= p else f"({left.text})"
    # a + (b - c) and a * (b / c) need none; a - (b + c) and a / (b * c) do.
    bare_right = right.precedence > p or (right.precedence == p and op in "+*")
    right_text = right.text if bare_right else f"({right.text})"
    value = {"+": left.value + right.value, "-": left.value - right.value,
             "*": left.value * right.value, "/": left.value // right.value}[op]
    return _Expr(f"{left_text} {op} {right_text}", value, p)


def _random_expression(numbers: list[int], rng: np.random.Generator) -> _Expr:
    """Joins random pairs of the pool until one expression uses every number.

    The larger operand goes first, so every intermediate value stays a positive integer:
    `-` only when it leaves a positive result, `/` only when exact (and not by 1).
    """
    pool = [_Expr(str(n), n, 3) for n in numbers]
    while len(pool) > 1:
        i, j = sorted(rng.choice(len(pool), 2, replace=False).tolist())
        right, left = pool.pop(j), pool.pop(i)
        if left.value < right.value:
            left, right = right, left
        ops = ["+", "*"]
        ops += ["-"] if left.value > right.value else []
        ops += ["/"] if right.value > 1 and left.value % right.value == 0 else []
        pool.append(_combine(left, ops[int(rng.integers(len(ops)))], right))
    return pool[0]


def countdown(num: int, seed: int, cfg: DataConfig = DataConfig()) -> list[dict]:
    """`num` Countdown problems (the game TinyZero trains on): reach a target from
    `cfg.countdown_numbers` numbers in 1..`cfg.countdown_max` with + - * /, using each
    number at most once.

    The target is the value of a random expression over all the numbers, so `solution`
    always reaches it. Targets above max(1000, count * countdown_max) are drawn again (a
    sum of all the numbers always fits). Items look like
    {"prompt": "Using the numbers [3, 7, 12], make 33. You may use + - * / and each number
    at most once. Answer with the expression.\\nExpression:", "completion": " 3 * 7 + 12",
    "answer": "33", "numbers": [3, 7, 12], "solution": "3 * 7 + 12"}.
    """
    max_target = max(1000, cfg.countdown_numbers * cfg.countdown_max)
    rng = np.random.default_rng(seed)
    items = []
    while len(items) < num:
        numbers = rng.integers(1, cfg.countdown_max + 1, cfg.countdown_numbers).tolist()
        solution = _random_expression(numbers, rng)
        if solution.value > max_target:
            continue
        prompt = (f"Using the numbers {numbers}, make {solution.value}. You may use + - * / "
                  f"and each number at most once. Answer with the expression.\nExpression:")
        items.append({"prompt": prompt, "completion": f" {solution.text}",
                      "answer": str(solution.value), "numbers": numbers,
                      "solution": solution.text})
    return items


# Word-problem templates of the calculator task: {a} and {b} are the operands, by operator.
_WORD_PROBLEMS = {
    "+": ("Sam has {a} apples and buys {b} more. How many apples does Sam have now?",
          "A shop sold {a} pens in the morning and {b} pens in the afternoon. How many pens did it sell?",
          "A bus carries {a} people and {b} more get on. How many people are on the bus?"),
    "-": ("Sam has {a} apples and gives away {b}. How many apples does Sam have left?",
          "A tank holds {a} liters and {b} liters leak out. How many liters are left?",
          "A library had {a} books and lent out {b}. How many books are still there?"),
    "*": ("A box holds {a} eggs. How many eggs are in {b} boxes?",
          "A ticket costs {a} dollars. How much do {b} tickets cost?",
          "A farmer plants {b} rows of {a} trees. How many trees does he plant?"),
}


def tool_call(name: str, **arguments: object) -> str:
    """A tool call as the hermes format writes it (Qwen 2.5 / 3 chat templates)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def calculator(num: int, seed: int, cfg: DataConfig = DataConfig()) -> list[dict]:
    """`num` arithmetic word problems for the calculator environment (`env=calculator`),
    the operands and operators of `arithmetic` in a sentence; the worked completion calls
    the calculator and answers with its result (the few-shot demonstrations):
    {"prompt": "Q: Sam has 37 apples and buys 25 more. How many apples does Sam have
    now?\n", "completion": "<tool_call>{...\"expression\": \"37 + 25\"}}</tool_call>\n
    <tool_response>62</tool_response>\nAnswer: 62", "answer": "62"}."""
    rng = np.random.default_rng([seed, 3])
    items = []
    for item in arithmetic(num, seed, cfg):
        a, op, b = item["prompt"].rstrip(" =").split(" ")
        question = _WORD_PROBLEMS[op][int(rng.integers(len(_WORD_PROBLEMS[op])))].format(a=a, b=b)
        result = item["answer"]
        work = (tool_call("calculator", expression=f"{a} {op} {b}") + "\n"
                f"<tool_response>{result}</tool_response>\nAnswer: {result}")
        items.append({"prompt": f"Q: {question}\n", "completion": work, "answer": result})
    return items


def guess_number(num: int, seed: int, cfg: DataConfig = DataConfig()) -> list[dict]:
    """`num` games of guess-the-number (`env=guess_number`): a secret in data.a_range; the
    worked completion is a bisection game, the environment answering "Higher." or
    "Lower.": {"prompt": "I am thinking of a number from 1 to 20. Guess it.\nGuess:",
    "completion": " 10\nHigher.\nGuess: 15\nLower.\nGuess: 12", "answer": "12"}."""
    lo, hi = cfg.a_range
    rng = np.random.default_rng([seed, 4])
    items = []
    for game, secret in enumerate(rng.integers(lo, hi + 1, num).tolist(), 1):
        low, high, lines = lo, hi, []
        while True:
            guess = (low + high) // 2
            lines.append(f" {guess}")
            if guess == secret:
                break
            hint = "Higher." if guess < secret else "Lower."
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
            lines.append(f"\n{hint}\nGuess:")
        items.append({"prompt": f"Game {game}. I am thinking of a number from {lo} to {hi}. "
                                f"Guess it.\nGuess:",
                      "completion": "".join(lines), "answer": str(secret)})
    return items


TASKS: dict[str, Callable[[int, int, DataConfig], list[dict]]] = {
    "arithmetic": arithmetic, "arithmetic_prefs": arithmetic_prefs, "countdown": countdown,
    "calculator": calculator, "guess_number": guess_number}

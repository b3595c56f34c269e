"""Built-in generated tasks with verifiable answers.

Each task is `fn(num, seed, cfg) -> [{"prompt", "completion", "answer", ...}, ...]`:
deterministic in `seed`, prefix-stable in `num` (a larger `num` extends the list rather than
changing it), and shaped by its own fields of `cfg` (a DataConfig).
"""

from __future__ import annotations

import json
import re
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


# The calculator task's word problems: (question, expression) with numbers {a} {b} {c},
# two different names {n} {m} and an item {i}. Two-step problems need the whole expression
# in one call (or two calls).
_WORD_PROBLEMS = (
    ("{n} has {a} {i}. {m} gives {n} {b} more. How many {i} does {n} have now?", "{a} + {b}"),
    ("On Monday {n} read {a} pages and on Tuesday {b} pages. How many pages did {n} read in all?",
     "{a} + {b}"),
    ("{n} had {a} {i} and lost {b} of them. How many {i} are left?", "{a} - {b}"),
    ("A bus has {a} people. At a stop, {b} people get off. How many people are still on the bus?",
     "{a} - {b}"),
    ("Each box has {a} {i}. How many {i} are in {b} boxes?", "{a} * {b}"),
    ("{n} earns {a} dollars a day. How many dollars does {n} earn in {b} days?", "{a} * {b}"),
    ("{n} has {a} {i}, buys {b} more and then gives {c} away. How many {i} does {n} have?",
     "{a} + {b} - {c}"),
    ("{n} buys {a} packs with {b} {i} in each pack and finds {c} more. How many {i} does {n} have?",
     "{a} * {b} + {c}"),
)
_NAMES = ("Sam", "Mia", "Tom", "Ana", "Ben", "Lily", "Omar", "Zoe")
_ITEMS = ("apples", "stickers", "marbles", "books", "coins", "shells", "pens", "cards")
# Two worked problems before every question: Gemma 3 270M writes a well-formed call after
# them on every held-out problem, and prompts stay under 256 tokens (measured,
# docs/environments.md). Other demonstrations come from data.few_shot.
_CALCULATOR_DEMOS = (
    ("A shop had 84 pens and sold 29 of them. How many pens are left?", "84 - 29", 55),
    ("Mia buys 12 bags with 15 marbles in each bag and then loses 9. How many marbles does "
     "Mia have?", "12 * 15 - 9", 171),
)


def tool_call(name: str, **arguments: object) -> str:
    """A tool call as the hermes format writes it (Qwen 2.5 / 3 chat templates)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _worked(expression: str, result: object) -> str:
    """A calculator call, its response and the answer line."""
    return (f"{tool_call('calculator', expression=expression)}\n"
            f"<tool_response>{result}</tool_response>\nAnswer: {result}")


def calculator(num: int, seed: int, cfg: DataConfig = DataConfig()) -> list[dict]:
    """`num` arithmetic word problems for the calculator environment (`env=calculator`):
    eight templates (+, -, *, and two two-step ones), numbers in `cfg.a_range`, positive
    answers, templates whose operators are all in `cfg.ops`; two worked problems precede
    each question:
    {"prompt": "Q: A shop had 84 pens ...\nAnswer: 55\n\nQ: ...\n\nQ: Tom had 71 cards and
    lost 23 of them. How many cards are left?\n", "completion": "<tool_call>{\"name\":
    \"calculator\", \"arguments\": {\"expression\": \"71 - 23\"}}</tool_call>\n
    <tool_response>48</tool_response>\nAnswer: 48", "answer": "48"}."""
    templates = [t for t in _WORD_PROBLEMS if set(re.findall(r"[-+*]", t[1])) <= set(cfg.ops)]
    if not templates:
        raise ConfigError(f"data.ops={list(cfg.ops)} leaves no calculator word problem; use "
                          f"some of +, - and *.")
    lo, hi = cfg.a_range
    demos = "".join(f"Q: {q}\n{_worked(e, r)}\n\n" for q, e, r in _CALCULATOR_DEMOS)
    rng = np.random.default_rng([seed, 3])
    items = []
    while len(items) < num:
        question, expression = templates[int(rng.integers(len(templates)))]
        a, b, c = rng.integers(lo, hi + 1, 3).tolist()
        n, m = rng.choice(len(_NAMES), 2, replace=False).tolist()
        values = {"a": a, "b": b, "c": c}
        expr = expression.format(**values)
        result = _evaluate(expr)
        if result <= 0:
            continue
        text = question.format(**values, n=_NAMES[n], m=_NAMES[m],
                               i=_ITEMS[int(rng.integers(len(_ITEMS)))])
        items.append({"prompt": f"{demos}Q: {text}\n", "completion": _worked(expr, result),
                      "answer": str(result)})
    return items


def _evaluate(expression: str) -> int:
    """The value of "a op b [op c]" with * before + and - (the templates' expressions)."""
    tokens = expression.split()
    terms, signs = [int(tokens[0])], [1]
    for op, number in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            terms[-1] *= int(number)
        else:
            terms.append(int(number))
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


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


QUADRANTS = ("top left", "top right", "bottom left", "bottom right")


def quadrant(num: int, seed: int, cfg: DataConfig = DataConfig()) -> list[dict]:
    """`num` images (PNG bytes, 32 x 32) of a red dot and three blue distractor dots on a
    noisy grey ground, asking which quadrant holds the red dot (a visual task a tiny
    vision-language model learns on CPU): {"prompt": "<start_of_image>Which quadrant holds
    the red dot?\nAnswer:", "completion": " top left", "answer": "top left",
    "images": [png]}."""
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    side, radius = 32, 3
    items = []
    for _ in range(num):
        image = rng.integers(96, 160, (side, side, 1)).repeat(3, axis=2).astype(np.uint8)
        which = int(rng.integers(4))
        spots = [which] + rng.choice([q for q in range(4) if q != which], 3).tolist()
        for k, q in enumerate(spots):
            y0, x0 = (q // 2) * side // 2, (q % 2) * side // 2
            y = rng.integers(y0 + radius, y0 + side // 2 - radius)
            x = rng.integers(x0 + radius, x0 + side // 2 - radius)
            colour = (220, 30, 30) if k == 0 else (30, 60, 220)
            yy, xx = np.ogrid[:side, :side]
            image[(yy - y) ** 2 + (xx - x) ** 2 <= radius ** 2] = colour
        png = io.BytesIO()
        Image.fromarray(image).save(png, format="PNG")
        items.append({"prompt": "<start_of_image>Which quadrant holds the red dot?\nAnswer:",
                      "completion": f" {QUADRANTS[which]}", "answer": QUADRANTS[which],
                      "images": [png.getvalue()]})
    return items


TASKS: dict[str, Callable[[int, int, DataConfig], list[dict]]] = {
    "arithmetic": arithmetic, "arithmetic_prefs": arithmetic_prefs, "countdown": countdown,
    "calculator": calculator, "guess_number": guess_number, "quadrant": quadrant}

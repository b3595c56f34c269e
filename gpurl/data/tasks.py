"""Built-in generated tasks with verifiable answers.

Each task is `fn(num, seed) -> [{"prompt", "completion", "answer"}, ...]`: deterministic in
`seed`, and prefix-stable in `num` (a larger `num` extends the list rather than changing it).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

_MAX_OPERAND = 99


def _arithmetic_space() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (a, b, is_subtraction) items: a + b, and a - b with a >= b, for a, b in 0..99."""
    a_P, b_P = np.meshgrid(np.arange(_MAX_OPERAND + 1), np.arange(_MAX_OPERAND + 1), indexing="ij")
    a_P, b_P = a_P.reshape(-1), b_P.reshape(-1)
    nonneg_P = a_P >= b_P
    a_S = np.concatenate([a_P, a_P[nonneg_P]])
    b_S = np.concatenate([b_P, b_P[nonneg_P]])
    sub_S = np.concatenate([np.zeros(a_P.size, bool), np.ones(int(nonneg_P.sum()), bool)])
    return a_S, b_S, sub_S


def arithmetic(num: int, seed: int) -> list[dict]:
    """`num` items like {"prompt": "12 + 7 =", "completion": " 19", "answer": "19"}.

    The first 15,050 items (every distinct problem) are unique; beyond that items repeat.
    No few-shot examples: the format is meant for a tiny model learning from scratch.
    """
    a_S, b_S, sub_S = _arithmetic_space()
    rng = np.random.default_rng(seed)
    pick_N = rng.permutation(a_S.size)[:num]
    if num > a_S.size:
        pick_N = np.concatenate([pick_N, rng.integers(0, a_S.size, num - a_S.size)])
    a_N, b_N, sub_N = a_S[pick_N], b_S[pick_N], sub_S[pick_N]
    result_N = np.where(sub_N, a_N - b_N, a_N + b_N)
    return [
        {"prompt": f"{a} {'-' if sub else '+'} {b} =", "completion": f" {r}", "answer": str(r)}
        for a, b, sub, r in zip(a_N.tolist(), b_N.tolist(), sub_N.tolist(), result_N.tolist())
    ]


TASKS: dict[str, Callable[[int, int], list[dict]]] = {"arithmetic": arithmetic}

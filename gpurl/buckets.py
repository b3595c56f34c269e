"""Shape buckets: sizes rounded up so that a run compiles few distinct programs.

`power_of_two` (O(log n) shapes: rows, prompt widths, block tables) and `three_bits`
(values with three significant bits: at most 25% over, usually about 10%, for sizes whose
largest allocation matters: the KV pool's blocks, packed rows' lengths). Plain Python:
the rollout scheduler's tests import it without JAX."""

from __future__ import annotations


def power_of_two(n: int, minimum: int = 1) -> int:
    """Next power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def three_bits(n: int) -> int:
    """n rounded up to a value with three significant bits (1..8, 10, 12, 14, 16, 20, 24,
    28, 32, 40, ...)."""
    if n <= 8:
        return max(n, 1)
    step = 1 << (int(n).bit_length() - 3)
    return -(-n // step) * step

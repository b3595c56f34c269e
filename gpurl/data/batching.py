"""Which rows each optimizer step reads, as a pure function of (seed, step).

Nothing about the data order is stored: step s of any run with the same seed and row
count reads the same rows, so resuming from a checkpoint at step s continues exactly
where the run stopped, whatever the number of processes.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from gpurl.config import ConfigError
from gpurl.data.sft import TokenRows

ROW_FIELDS = ("tokens", "positions", "segment_ids", "loss_mask")


def step_indices(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """(B,) int64 global row indices of optimizer step `step` (0-based).

    The index stream is epoch 0's permutation, then epoch 1's, ...; epoch e is
    `default_rng([seed, e]).permutation(num_rows)`. Step s reads stream[s*B : (s+1)*B], so
    a batch may straddle epochs and B may exceed the row count.
    """
    if num_rows <= 0:
        raise ConfigError("There are no training rows to batch; check the data config.")
    start, stop = step * batch_size, (step + 1) * batch_size
    parts = []
    for epoch in range(start // num_rows, (stop - 1) // num_rows + 1):
        perm_X = np.random.default_rng([seed, epoch]).permutation(num_rows)
        lo = max(start - epoch * num_rows, 0)
        hi = min(stop - epoch * num_rows, num_rows)
        parts.append(perm_X[lo:hi])
    return np.concatenate(parts).astype(np.int64)


def check_processes(batch_size: int, process_count: int) -> None:
    """Every process loads the same number of a step's rows."""
    if batch_size % process_count:
        raise ConfigError(
            f"train.batch_size={batch_size} is not divisible by the {process_count} processes; "
            f"set train.batch_size to a multiple of {process_count}.")


def process_rows(indices: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """The contiguous slice of a global batch's `indices` that this process loads."""
    batch_size = len(indices)
    check_processes(batch_size, process_count)
    per_process = batch_size // process_count
    return indices[process_index * per_process:(process_index + 1) * per_process]


def take(rows: TokenRows, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The row arrays of `indices`: {"tokens", "positions", "segment_ids", "loss_mask"},
    and a vision-language model's rows' images, "pixels" (`TokenRows.pixels`)."""
    out = {name: getattr(rows, name)[indices] for name in ROW_FIELDS}
    if rows.images is not None:
        out["pixels"] = rows.pixels(indices)
    return out


def eval_batches(rows: TokenRows, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Every row once, in order, in batches of `batch_size`.

    The last batch is filled with all-padding rows (segment 0, no loss) so a jitted eval
    step compiles once.
    """
    for start in range(0, len(rows), batch_size):
        batch = take(rows, np.arange(start, min(start + batch_size, len(rows))))
        missing = batch_size - len(batch["tokens"])
        if missing:
            batch = {name: _pad_rows(array, missing, rows.pad_id if name == "tokens" else 0)
                     for name, array in batch.items()}
        yield batch


def _pad_rows(array_Bx_: np.ndarray, missing: int, value: int) -> np.ndarray:
    pad = np.full((missing,) + array_Bx_.shape[1:], value, array_Bx_.dtype)
    return np.concatenate([array_Bx_, pad])

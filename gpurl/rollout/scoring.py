"""Rewards computed where the completions live: `shard_map` over every mesh axis with one
`io_callback` per shard.

Each device holds a distinct slice of the rows' ids (rows are split over all mesh axes, so
a tensor-parallel replica does not score its rows twice); its callback, on the host that
owns the device, looks those rows' tokens up among the completions that host generated
(`RowContext`: they never went to a device for this), decodes them, calls the reward
functions, and returns the scores as that device's slice of a sharded array. No process
fetches or iterates rows it does not address, and every row is scored exactly once in the
whole job.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gpurl.models.tokenizer import Tokenizer
from gpurl.rewards import Reward, RewardError, score_rows
from gpurl.rollout.decode import truncate

# Keys of a data row that are not metadata for the reward functions.
_NOT_METADATA = ("prompt", "messages")


@dataclass(frozen=True)
class RowContext:
    """What the host needs to score global row r: the prompt row (text + metadata) of
    row r is `rows[r // group]`; this process's completions are `tokens` (B_local x N) and
    `lengths`, of global rows `ids` (-1: padding)."""

    rows: Sequence[dict]
    group: int
    ids: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray

    def local(self, ids_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, lengths) of global rows `ids_B`, all of them this process's."""
        where = {int(r): i for i, r in enumerate(self.ids) if r >= 0}
        at = np.asarray([where[int(r)] for r in ids_B], np.int64)
        return self.tokens[at], self.lengths[at]


class ShardedScorer:
    """`scorer(row_ids_B, context)` -> B x (2 + functions) float32
    sharded like the rows: column 0 is the weighted total, column 1 + f reward function f's
    score, the last column 1 where a function failed and the row was scored 0
    (rewards.on_error=zero). Row id -1 marks a padding row (scored 0, no function called)."""

    def __init__(self, mesh: Mesh, rewards: Sequence[Reward], tokenizer: Tokenizer,
                 stop: Sequence[str]):
        self.mesh, self.rewards, self.tokenizer, self.stop = mesh, list(rewards), tokenizer, stop
        self.axes = tuple(mesh.axis_names)
        self.rows = NamedSharding(mesh, P(self.axes))
        self._context: RowContext | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.calls = 0  # rows scored by this process (a test counts them across processes)
        width = 2 + len(self.rewards)

        def per_shard(ids_B):
            out = jax.ShapeDtypeStruct((ids_B.shape[0], width), jnp.float32)
            return io_callback(self._host, out, ids_B)

        spec = P(self.axes)
        self._fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec))

    def __call__(self, row_ids_B: jax.Array, context: RowContext) -> jax.Array:
        """Scores of the rows `row_ids_B` (row-sharded). Waits for them: a failed reward
        function is raised here, before anything trains on the round."""
        self._context, self._error = context, None
        scores = jax.block_until_ready(self._fn(jax.device_put(row_ids_B, self.rows)))
        if self._error is not None:  # re-raised here: inside XLA it would be wrapped
            raise self._error
        return scores

    def completions(self, tokens_BxN: np.ndarray, lengths_B: np.ndarray) -> list[str]:
        return [truncate(self.tokenizer.decode(row[:n]), self.stop)
                for row, n in zip(tokens_BxN, lengths_B)]

    def _host(self, ids_B: Any) -> np.ndarray:
        """One shard's rows (B of them) scored on the host that holds the shard."""
        ids_B = np.asarray(ids_B)
        out = np.zeros((len(ids_B), 2 + len(self.rewards)), np.float32)
        real = np.flatnonzero(ids_B >= 0)
        if real.size == 0:
            return out
        ctx = self._context
        rows = [ctx.rows[int(ids_B[i]) // ctx.group] for i in real]
        keys = [k for k in rows[0] if k not in _NOT_METADATA]
        metadata = {k: [row.get(k) for row in rows] for k in keys}
        completions = self.completions(*ctx.local(ids_B[real]))
        try:
            scores = score_rows(self.rewards, [r["prompt"] for r in rows], completions,
                                metadata, first_row=int(ids_B[real[0]]))
        except RewardError as e:  # names the function and the row
            self._error = e
            return out
        out[real, 0] = scores.total
        for f, reward in enumerate(self.rewards):
            out[real, 1 + f] = scores.parts[reward.name]
        out[real, -1] = scores.errors
        with self._lock:
            self.calls += real.size
        return out

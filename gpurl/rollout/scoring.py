"""Rewards computed where the completions live: `shard_map` over every mesh axis with one
`io_callback` per shard.

Each device holds a distinct slice of the rows (rows are split over all mesh axes, so a
tensor-parallel replica does not score its rows twice); its callback decodes those rows
on the host that owns the device, calls the reward functions, and returns the scores as
that device's slice of a sharded array. No process fetches or iterates rows it does not
address, and every row is scored exactly once in the whole job.
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
    row r is `rows[r // group]`."""

    rows: Sequence[dict]
    group: int = 1


class ShardedScorer:
    """`scorer(tokens_BxN, lengths_B, row_ids_B, context)` -> B x (2 + functions) float32
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

        def per_shard(tokens_BxN, lengths_B, ids_B):
            out = jax.ShapeDtypeStruct((tokens_BxN.shape[0], width), jnp.float32)
            return io_callback(self._host, out, tokens_BxN, lengths_B, ids_B)

        spec = P(self.axes)
        self._fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, spec, spec),
                                         out_specs=spec))

    def __call__(self, tokens_BxN: jax.Array, lengths_B: jax.Array, row_ids_B: jax.Array,
                 context: RowContext) -> jax.Array:
        self._context, self._error = context, None
        args = [jax.device_put(x, self.rows) for x in (tokens_BxN, lengths_B, row_ids_B)]
        scores = jax.block_until_ready(self._fn(*args))
        if self._error is not None:  # re-raised here: inside XLA it would be wrapped
            raise self._error
        return scores

    def completions(self, tokens_BxN: np.ndarray, lengths_B: np.ndarray) -> list[str]:
        return [truncate(self.tokenizer.decode(row[:n]), self.stop)
                for row, n in zip(tokens_BxN, lengths_B)]

    def _host(self, tokens_BxN: Any, lengths_B: Any, ids_B: Any) -> np.ndarray:
        """One shard's rows (B of them) scored on the host that holds the shard."""
        tokens_BxN, lengths_B, ids_B = (np.asarray(x) for x in (tokens_BxN, lengths_B, ids_B))
        out = np.zeros((len(ids_B), 2 + len(self.rewards)), np.float32)
        real = np.flatnonzero(ids_B >= 0)
        if real.size == 0:
            return out
        ctx = self._context
        rows = [ctx.rows[int(ids_B[i]) // ctx.group] for i in real]
        keys = [k for k in rows[0] if k not in _NOT_METADATA]
        metadata = {k: [row.get(k) for row in rows] for k in keys}
        completions = self.completions(tokens_BxN[real], lengths_B[real])
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

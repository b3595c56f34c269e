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
from gpurl.rewards import Reward, RewardError, score_rows, thinking
from gpurl.rollout.decode import truncate

# Keys of a data row that are not metadata for the reward functions.
_NOT_METADATA = ("prompt", "messages")
# The scorer's last two columns (an environment's reward column goes in at 1, before the
# functions': these stay last): 1 where a function failed and the row was scored 0
# (rewards.on_error=zero); 1 where the completion was cut at the token limit.
ERRORS, CUT = -2, -1


@dataclass(frozen=True)
class RowContext:
    """What the host needs to score global row r: the prompt row (text + metadata) of
    row r is `rows[r // group]`; this process's completions are `tokens` (B_local x N) and
    `lengths`, of global rows `ids` (-1: padding), whether each ended on a stop id
    (`stopped`, else at its token limit or an environment's end) and whether its prompt
    left a thinking trace open (`opened`)."""

    rows: Sequence[dict]
    group: int
    ids: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray
    opened: np.ndarray

    def local(self, ids_B: np.ndarray) -> tuple[np.ndarray, ...]:
        """(tokens, lengths, stopped, opened) of global rows `ids_B`, all this process's."""
        where = {int(r): i for i, r in enumerate(self.ids) if r >= 0}
        at = np.asarray([where[int(r)] for r in ids_B], np.int64)
        return self.tokens[at], self.lengths[at], self.stopped[at], self.opened[at]


class ShardedScorer:
    """`scorer(row_ids_B, context)` -> B x (3 + functions) float32
    sharded like the rows: column 0 is the weighted total, column 1 + f reward function f's
    score, then `ERRORS` and `CUT`. Row id -1 marks a padding row (scored 0, no function
    called). Every function is also given `finished` (`gpurl.rewards.thinking`): whether
    each completion ended by itself with its thinking trace closed."""

    def __init__(self, mesh: Mesh, rewards: Sequence[Reward], tokenizer: Tokenizer,
                 stop: Sequence[str]):
        self.mesh, self.rewards, self.tokenizer, self.stop = mesh, list(rewards), tokenizer, stop
        self.axes = tuple(mesh.axis_names)
        self.rows = NamedSharding(mesh, P(self.axes))
        self._context: RowContext | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.calls = 0  # rows scored by this process (a test counts them across processes)
        width = 3 + len(self.rewards)

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
        return self._texts(tokens_BxN, lengths_B)[0]

    def _texts(self, tokens_BxN: np.ndarray, lengths_B: np.ndarray) -> tuple[list[str], list[bool]]:
        """(each completion's text up to its first stop string, whether it had one)."""
        texts = [self.tokenizer.decode(row[:n]) for row, n in zip(tokens_BxN, lengths_B)]
        cut = [truncate(t, self.stop) for t in texts]
        return cut, [len(c) < len(t) for c, t in zip(cut, texts)]

    def _host(self, ids_B: Any) -> np.ndarray:
        """One shard's rows (B of them) scored on the host that holds the shard."""
        ids_B = np.asarray(ids_B)
        out = np.zeros((len(ids_B), 3 + len(self.rewards)), np.float32)
        real = np.flatnonzero(ids_B >= 0)
        if real.size == 0:
            return out
        ctx = self._context
        rows = [ctx.rows[int(ids_B[i]) // ctx.group] for i in real]
        keys = [k for k in rows[0] if k not in _NOT_METADATA]
        metadata = {k: [row.get(k) for row in rows] for k in keys}
        tokens, lengths, stopped, opened = ctx.local(ids_B[real])
        completions, at_stop_string = self._texts(tokens, lengths)
        ended = [bool(s) or a for s, a in zip(stopped, at_stop_string)]
        metadata["finished"] = [thinking.finished(c, e, bool(o))
                                for c, e, o in zip(completions, ended, opened)]
        out[real, CUT] = np.logical_not(ended)
        try:
            scores = score_rows(self.rewards, [r["prompt"] for r in rows], completions,
                                metadata, first_row=int(ids_B[real[0]]))
        except RewardError as e:  # names the function and the row
            self._error = e
            return out
        out[real, 0] = scores.total
        for f, reward in enumerate(self.rewards):
            out[real, 1 + f] = scores.parts[reward.name]
        out[real, ERRORS] = scores.errors
        with self._lock:
            self.calls += real.size
        return out

"""The rollout engine: continuous batching over decode slots with a paged KV cache.

Every caller's generation goes through `Engine.generate`: RL rounds and pass@k evaluation
(`rounds.Rounds`), `gpurl generate`, and multi-turn environments (`resume`). Each
process's engine serves only its own requests, split over its data shards. The engine is
split by job:

- `requests`: what callers give and get (`Request`, `Completion`);
- `blocks`: the KV pool's free blocks and reference counts, and its sizing;
- `scheduler`: per call, admission into `rollout.slots` decode slots per shard, blocks a
  chunk ahead, preemption when the pool is full, the host arrays of each device call;
- `programs`: the prefill and the decode chunk (jitted on bucketed shapes, compiled ahead
  of time for a round's largest), the stop table;
- this module: the loop that drives them and keeps the KV pool on the devices.

A scheduling iteration makes one host gather of a few integers between processes
(`gpurl.distributed.host.gather`: the program shapes and whether anyone prefills or
decodes), plus one at the start of a call (the pool's size), so on multi-node GPUs a
decode chunk costs one network round trip besides its device work.

The KV cache is a pool of blocks of `rollout.block_size` tokens per shard
(`gpurl.kernels.paged_attention`): a request holds blocks only for the tokens it has
(allocated a chunk ahead), the G completions of one prompt share the prompt's full
blocks, and a finished request's blocks return to the pool at once. The pool is sized
for the call's requests at their own limits, capped by `rollout.kv_cache_tokens`; when
the cap is reached the most recently admitted request gives its blocks back and is
admitted again later with its tokens so far (recomputed by a prefill), as vLLM does. A
decode chunk returns early once enough rows finished for the host to refill their slots,
or once half of the rows are done, so the next chunk can run on half as many rows (not
below `MIN_DECODE_ROWS` unless the call starts smaller).

A request's tokens do not depend on what shares its batch or which slot it lands in: its
sampling keys are fold_in(key(seed), i) for its i-th token (as `static.StaticSampler`,
the reference, draws them), every row's arithmetic is its own, fully masked KV blocks
leave the attention's running sums exactly unchanged. Log-probs agree to float32
rounding: XLA's CPU matmul picks its kernel by the row count (measured: a 640-wide
projection gives bit-equal rows for 2..32 rows, but not for 1 row or from 64 rows on), so
a batch of another size can move their last bit. A decode batch of one row is kept for
its speed (the one-row head matmul of Gemma 3's 262k vocabulary takes 22 ms on this CPU,
two rows 36 ms). Log-probs are those of the distribution sampled from before top-k /
top-p truncation (`sampling.sample_rows`).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gpurl.distributed import host
from gpurl.models.spec import Params
from gpurl.models.transformer import compute_dtype
from gpurl.rollout.programs import Programs
from gpurl.rollout.requests import MIN_DECODE_ROWS, Completion, Request, bucket
from gpurl.rollout.scheduler import Limits, Needs, Scheduler


class Engine(Programs):
    """Generates completions of requests on the rollout mesh (data, tp)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pool: tuple[jax.Array, jax.Array] | None = None  # keys, values (`pool_shape`)
        self.stats: dict[str, float] = {}  # the last call's counts and times

    def generate(self, params: Params, requests: Sequence[Request],
                 resume: Callable[[int, Completion], Request | None] | None = None,
                 prefill_width: int = 0) -> list[Completion]:
        """Completions of this process's `requests`, in order. `resume(i, completion)` is
        called as request i finishes; a Request it returns (e.g. the completion plus an
        environment's reply appended to the prompt) is queued in its place, and the last
        completion of each index is returned. `prefill_width`: pad prefills to at least
        this many tokens (RL: one prefill shape per run). Every process must call this
        together."""
        sched = self._scheduler(requests, resume, prefill_width)
        params = self.place(params)
        floor, width, blocks = (int(x) for x in host.gather(sched.first_needs()).max(axis=0))
        sched.start(self._ensure_pool(blocks))
        self.stats = _counts()
        started, planned = time.perf_counter(), self.planned_calls
        busy = True
        while busy:
            busy, width = self._iterate(params, sched, floor, width)
        self.stats.update(sched.stats, planned_calls=self.planned_calls - planned)
        self.stats["host_s"] = (time.perf_counter() - started - self.stats["prefill_s"]
                                - self.stats["decode_s"])
        return sched.completions()

    def stream(self, prefill_width: int = 0, state: dict | None = None) -> "Stream":
        """A generation that requests join while it runs (`Stream`), or the one whose
        `Stream.snapshot` is `state`. Every process must call this, and then
        `Stream.iterate`, together."""
        return Stream(self, prefill_width, state)

    def _scheduler(self, requests: Sequence[Request], resume: Callable | None,
                   prefill_width: int) -> Scheduler:
        cfg = self.cfg
        return Scheduler(requests, Limits(cfg.slots, cfg.block_size, cfg.decode_chunk,
                                          cfg.kv_cache_tokens),
                         self.local_shards, self.stop_set, resume, prefill_width, self.routes_shape)

    def _iterate(self, params: Params, sched: Scheduler, floor: int, width: int) -> tuple[bool, int]:
        """One scheduling iteration: the agreed needs of every process (one host gather),
        then the prefill of admitted requests and a decode chunk of the live rows. Returns
        (whether any process still has requests, the block table's width)."""
        needs = Needs.agree(host.gather(sched.plan()))
        self.stats["iterations"] += 1
        if needs.blocks:
            sched.grow(self._ensure_pool(needs.blocks))
        width = max(width, needs.table)
        if needs.prefill:
            self._prefill(params, sched, needs)
        if not needs.decoding:
            return bool(needs.queued), width
        self._decode(params, sched, max(needs.decoding, floor), floor, width, needs.queued)
        return True, width

    def _ensure_pool(self, blocks: int) -> int:
        """Allocates the KV pool with `blocks` blocks per shard, or grows it in place (live
        blocks keep their ids) when it is smaller; returns its blocks."""
        if self._pool is None:
            shape, dtype = self.pool_shape(blocks), compute_dtype(self.spec.cfg)
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.pool_sharding)
            self._pool = (zeros(), zeros())
        elif self._pool[0].shape[2] < blocks:
            extra = blocks - self._pool[0].shape[2]
            pad = jax.jit(lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra)) + ((0, 0),) * 3),
                          out_shardings=self.pool_sharding, donate_argnums=0)
            self._pool = tuple(pad(x) for x in self._pool)
        return self._pool[0].shape[2]

    def _rows(self, local: np.ndarray) -> jax.Array:
        """Shards x rows x ... of this process -> the global row-sharded array."""
        return host.to_device(local.reshape(-1, *local.shape[2:]), self.rows)

    def _prefill(self, params: Params, sched: Scheduler, needs: Needs) -> None:
        batch = sched.prefill_batch(needs, self._pool[0].shape[2], self.pad_id)
        settings = batch["settings"]
        k, v = self._pool
        args = (params, k, v, *(self._rows(batch[x]) for x in ("tokens", "lengths", "dest", "src")),
                *(host.to_device(x, self.rows) for x in settings.arrays()), self.stops())
        t0 = time.perf_counter()
        k, v, tok_B, lp_B, stop_B = self.run(self.prefill, (settings.sampled, settings.truncate),
                                             args)
        self._pool = (k, v)
        shape = (sched.count, needs.rows)
        sched.accept_prefill(*(host.local(x).reshape(shape) for x in (tok_B, lp_B, stop_B)))
        self.stats["prefills"] += 1
        self.stats["prefill_s"] += time.perf_counter() - t0

    def _decode(self, params: Params, sched: Scheduler, n: int, floor: int, width: int,
                queued: int) -> None:
        """One decode chunk of `n` rows per shard (not fewer than `floor`); with `queued` requests waiting it returns
        once the queue can refill enough slots (a quarter of them), or when every shard has
        at most half its rows left (the next chunk runs on half as many)."""
        batch = sched.chunk_batch(n, width)
        settings = batch["settings"]
        take = min(queued, max(1, self.cfg.slots // 4)) if queued else 0
        halve = n // 2 if n > floor else 0
        k, v = self._pool
        static = (settings.sampled, settings.truncate, self.cfg.decode_chunk)
        args = (params, k, v, self._rows(batch["table"]),
                *(self._rows(x) for x in batch["state"]), self._rows(batch["active"]),
                *(host.to_device(x, self.rows) for x in settings.arrays()), self.stops(),
                np.int32(take), np.int32(halve))
        t0 = time.perf_counter()
        k, v, out_BxC, lp_BxC, emitted_B, stopped_B, steps, *routes = self.run(self.chunk, static,
                                                                               args)
        self._pool = (k, v)
        d = sched.count
        out, lp = (host.local(x).reshape(d, n, -1) for x in (out_BxC, lp_BxC))
        emitted, stopped = (host.local(x).reshape(d, n) for x in (emitted_B, stopped_B))
        routes_host = host.local(routes[0]).reshape(d, n, *routes[0].shape[1:]) if routes else None
        sched.accept_chunk(out, lp, emitted, stopped, routes_host)
        steps = int(steps)
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["chunks"] += 1
        self.stats["steps"] += steps
        self.stats["row_steps"] += steps * n * self.shards


class Stream:
    """A generation that requests join at any time (continuous RL): `add` queues a
    prompt's group, `iterate(params, version)` runs one scheduling iteration with the
    parameters of policy `version`, and `finished` hands over the completions finished
    since its last call, in the order they finished. A new version enters between two
    decode chunks: the requests in flight keep the KV cache the old weights wrote and go on
    with the new ones, and every token records the version that sampled it
    (`Completion.versions`). `drop_stale` starts over the requests holding tokens older
    than a version. Every process calls `iterate` together (one host gather each). The
    stream has a KV pool of its own: the engine's `generate` (an evaluation) runs beside it."""

    def __init__(self, engine: Engine, prefill_width: int = 0, state: dict | None = None):
        self.engine = engine
        self.sched = engine._scheduler([], None, prefill_width)
        self.floor = bucket(min(engine.cfg.slots, MIN_DECODE_ROWS))
        _, self.width, blocks = (int(x) for x in host.gather(self.sched.first_needs()).max(axis=0))
        if state is not None:  # the pool and table sizes of the snapshot: the same programs
            self.width, blocks = state["width"], state["blocks"]
        saved, engine._pool = engine._pool, None
        self.sched.start(engine._ensure_pool(blocks))
        self.pool, engine._pool = engine._pool, saved
        self.stats = _counts()
        self._handed = 0
        if state is not None:
            self.sched.load(state["scheduler"])
            self.stats.update(state["stats"])
            self._handed = state["handed"]

    def snapshot(self) -> dict:
        """The stream as plain data, its decoding requests flushed to their queues first
        (`Scheduler.flush`): a stream rebuilt from it (`Engine.stream(state=...)`) goes on
        exactly as this one does after the flush."""
        return {"scheduler": self.sched.snapshot(), "width": self.width,
                "blocks": int(self.pool[0].shape[2]), "handed": self._handed,
                "stats": dict(self.stats)}

    def add(self, requests: Sequence[Request]) -> list[int]:
        """Queues one prompt's requests (they stay on one data shard); their indices."""
        return self.sched.add(requests)

    def iterate(self, params: Params, version: int) -> bool:
        """One scheduling iteration with `params`, the policy of `version`; False when no
        process has a request queued or decoding."""
        engine, sched = self.engine, self.sched
        saved, engine._pool, engine.stats = engine._pool, self.pool, self.stats
        sched.version = version
        try:
            busy, self.width = engine._iterate(engine.place(params), sched, self.floor, self.width)
        finally:
            self.pool, engine._pool = engine._pool, saved
        self.stats.update(sched.stats)
        return busy

    def finished(self) -> list[tuple[int, Completion]]:
        """(index, completion) of the requests finished since the last call, in order."""
        done = self.sched.finished[self._handed:]
        self._handed = len(self.sched.finished)
        return [(i, self.sched.done[i]) for i in done]

    def started(self) -> dict[int, int]:
        """Index -> the version of its first token, of each unfinished request holding one."""
        return self.sched.started()

    def drop_stale(self, oldest: int) -> int:
        """Requests holding a token of a version below `oldest` start over (`Scheduler.
        drop_stale`); how many did."""
        return self.sched.drop_stale(oldest)


def _counts() -> dict[str, float]:
    return {"prefills": 0, "chunks": 0, "steps": 0, "row_steps": 0, "iterations": 0,
            "prefill_s": 0.0, "decode_s": 0.0}

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
blocks, and a finished request's blocks return to the pool at once; with the prefix cache
(`rollout.prefix_cache`) its full blocks stay remembered there, keyed by their tokens and
the policy version that computed them, until the pool needs them, and a later request with
the same prefix (the group's other completions, a multi-turn trajectory's next turn)
prefills only the tokens after it. The pool is sized
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
    """Generates completions of requests on the rollout mesh (data, tp): every generation
    is a `Stream`; `generate` adds every request to one and steps it until it is idle."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # `generate`'s KV pool (keys, values: `pool_shape`), kept between calls and grown in
        # place when a call needs more
        self._pool: tuple[jax.Array, jax.Array] | None = None
        self.stats: dict[str, float] = {}  # the last `generate`'s counts and times

    def generate(self, params: Params, requests: Sequence[Request],
                 resume: Callable[[int, Completion], Request | None] | None = None,
                 prefill_width: int = 0) -> list[Completion]:
        """Completions of this process's `requests`, in order. `resume(i, completion)` is
        called as request i finishes; a Request it returns (e.g. the completion plus an
        environment's reply appended to the prompt) is queued in its place, and the last
        completion of each index is returned. `prefill_width`: pad prefills to at least
        this many tokens (RL: one prefill shape per run). Every process must call this
        together."""
        started, planned = time.perf_counter(), self.planned_calls
        stream = Stream(self, prefill_width, requests=requests, resume=resume, pool=self._pool)
        while stream.iterate(params):
            pass
        self._pool = stream.pool
        self.stats = {**stream.stats, "planned_calls": self.planned_calls - planned}
        self.stats["host_s"] = (time.perf_counter() - started - self.stats["prefill_s"]
                                - self.stats["decode_s"])
        return stream.completions()

    def stream(self, prefill_width: int = 0, state: dict | None = None,
               resume: Callable[[int, Completion], Request | None] | None = None) -> "Stream":
        """A generation that requests join while it runs (`Stream`), with a KV pool of its
        own, or the one whose `Stream.snapshot` is `state`; `resume` as `generate`'s (a
        multi-turn row's next turn). Every process must call this, and then
        `Stream.iterate`, together."""
        return Stream(self, prefill_width, state, resume=resume)

    def scheduler(self, requests: Sequence[Request], resume: Callable | None,
                  prefill_width: int) -> Scheduler:
        """The plain-Python scheduler of a generation on this process's shards."""
        cfg, vision = self.cfg, self.spec.cfg.vision
        images = ((vision.image_token_id, (3, vision.image_size, vision.image_size))
                  if vision.layers else (-1, ()))
        return Scheduler(requests, Limits(cfg.slots, cfg.block_size, cfg.decode_chunk,
                                          cfg.kv_cache_tokens, cfg.prefix_cache, *images),
                         self.local_shards, self.stop_set, resume, prefill_width, self.routes_shape)


class Stream:
    """One generation on an engine's programs, with its own scheduler and KV pool: `add`
    queues a prompt's group at any time, `iterate(params, version)` runs one scheduling
    iteration, `finished` hands over the completions finished since its last call, in the
    order they finished. `Engine.generate` is a stream given every request up front and
    stepped until idle; continuous RL keeps one for the whole run. A new `version` enters
    between two decode chunks: the requests in flight keep the KV cache the old weights
    wrote and go on with the new ones, and every token records the version that sampled it
    (`Completion.versions`). `drop_stale` starts over the requests holding tokens older
    than a version. Every process calls `iterate` together (one host gather each)."""

    def __init__(self, engine: Engine, prefill_width: int = 0, state: dict | None = None, *,
                 requests: Sequence[Request] | None = None, resume: Callable | None = None,
                 pool: tuple[jax.Array, jax.Array] | None = None):
        self.engine = engine
        self.sched = engine.scheduler(requests or (), resume, prefill_width)
        floor, self.width, blocks = (int(x) for x in host.gather(self.sched.first_needs()).max(axis=0))
        # decode batches shrink as rows finish, not below the first batch's, agreed by every
        # process (`requests` None: a stream whose requests join later, the engine's least)
        self.floor = floor if requests is not None else bucket(min(engine.cfg.slots,
                                                                   MIN_DECODE_ROWS))
        if state is not None:  # the pool and table sizes of the snapshot: the same programs
            self.width, blocks = state["width"], state["blocks"]
        self.pool = pool
        self.sched.start(self._ensure_pool(blocks))
        self.stats = {**_counts(), **self.sched.stats}
        self._handed = 0
        self._given: Params | None = None  # the parameters last passed, and their placement
        self._placed: Params | None = None
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

    def iterate(self, params: Params, version: int | None = None) -> bool:
        """One scheduling iteration with `params` (placed in the sampling layout once per
        tree), the policy of `version` (None: the stream's current one): the agreed needs
        of every process (one host gather), then the prefill of admitted requests and a
        decode chunk of the live rows. False when no process has a request queued or
        decoding."""
        if params is not self._given:
            self._given, self._placed = params, self.engine.place(params)
        if version is not None:
            self.sched.version = version
        needs = Needs.agree(host.gather(self.sched.plan()))
        self.stats["iterations"] += 1
        if needs.blocks:
            self.sched.grow(self._ensure_pool(needs.blocks))
        self.width = max(self.width, needs.table)
        busy = bool(needs.queued)
        if needs.prefill:
            self._prefill(needs)
        if needs.decoding:
            self._decode(max(needs.decoding, self.floor), needs.queued)
            busy = True
        self.stats.update(self.sched.stats)
        return busy

    def finished(self) -> list[tuple[int, Completion]]:
        """(index, completion) of the requests finished since the last call, in order."""
        done = self.sched.finished[self._handed:]
        self._handed = len(self.sched.finished)
        return [(i, self.sched.done[i]) for i in done]

    def completions(self) -> list[Completion]:
        """Every request's last completion, in the order the requests were given."""
        return self.sched.completions()

    def started(self) -> dict[int, int]:
        """Index -> the version of its first token, of each unfinished request holding one."""
        return self.sched.started()

    def drop_stale(self, oldest: int) -> int:
        """Requests holding a token of a version below `oldest` start over (`Scheduler.
        drop_stale`); how many did."""
        return self.sched.drop_stale(oldest)

    def unfinished(self) -> list[int]:
        """The indices of the requests queued or decoding."""
        return [x.index for shard in self.sched.shards for x in [*shard.rows, *shard.queue]]

    def cancel(self, indices: set[int]) -> None:
        """The unfinished requests `indices` leave the stream (`Scheduler.cancel`)."""
        self.sched.cancel(indices)

    # ------------------------------------------------------------ device calls

    def _ensure_pool(self, blocks: int) -> int:
        """Allocates the KV pool with `blocks` blocks per shard, or grows it in place (live
        blocks keep their ids) when it is smaller; returns its blocks."""
        engine = self.engine
        if self.pool is None:
            shape, dtype = engine.pool_shape(blocks), compute_dtype(engine.spec.cfg)
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=engine.pool_sharding)
            self.pool = (zeros(), zeros())
        elif self.pool[0].shape[2] < blocks:
            extra = blocks - self.pool[0].shape[2]
            # (not donated: a larger pool cannot live in the old one's buffer, and JAX
            # warns of every donation it cannot use)
            pad = jax.jit(lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra)) + ((0, 0),) * 3),
                          out_shardings=engine.pool_sharding)
            self.pool = tuple(pad(x) for x in self.pool)
        return self.pool[0].shape[2]

    def _rows(self, local: np.ndarray) -> jax.Array:
        """Shards x rows x ... of this process -> the global row-sharded array."""
        return host.to_device(local.reshape(local.shape[0] * local.shape[1], *local.shape[2:]),
                              self.engine.rows)

    def _prefill(self, needs: Needs) -> None:
        engine, sched = self.engine, self.sched
        batch = sched.prefill_batch(needs, self.pool[0].shape[2], engine.pad_id)
        settings = batch["settings"]
        k, v = self.pool
        args = (self._placed, k, v,
                *(self._rows(batch[x]) for x in ("tokens", "starts", "lengths", "cached", "dest",
                                                 "src")),
                *(host.to_device(x, engine.rows) for x in settings.arrays()), engine.stops())
        if needs.images:  # (the ahead-of-time programs take none: text prefills match them)
            args += (self._rows(batch["pixels"]), self._rows(batch["image_offsets"]))
        t0 = time.perf_counter()
        k, v, tok_B, lp_B, stop_B = engine.run(engine.prefill,
                                               (settings.sampled, settings.truncate), args)
        self.pool = (k, v)
        shape = (sched.count, needs.rows)
        sched.accept_prefill(*(host.local(x).reshape(shape) for x in (tok_B, lp_B, stop_B)))
        self.stats["prefills"] += 1
        self.stats["prefill_s"] += time.perf_counter() - t0

    def _decode(self, n: int, queued: int) -> None:
        """One decode chunk of `n` rows per shard (not fewer than the floor); with `queued`
        requests waiting it returns once the queue can refill enough slots (a quarter of
        them), or when every shard has at most half its rows left (the next chunk runs on
        half as many)."""
        engine, sched = self.engine, self.sched
        batch = sched.chunk_batch(n, self.width)
        settings = batch["settings"]
        take = min(queued, max(1, engine.cfg.slots // 4)) if queued else 0
        halve = n // 2 if n > self.floor else 0
        k, v = self.pool
        static = (settings.sampled, settings.truncate, engine.cfg.decode_chunk)
        args = (self._placed, k, v, self._rows(batch["table"]),
                *(self._rows(x) for x in batch["state"]), self._rows(batch["active"]),
                *(host.to_device(x, engine.rows) for x in settings.arrays()), engine.stops(),
                np.int32(take), np.int32(halve))
        t0 = time.perf_counter()
        k, v, out_BxC, lp_BxC, emitted_B, stopped_B, steps, *routes = engine.run(
            engine.chunk, static, args)
        self.pool = (k, v)
        d = sched.count
        out, lp = (host.local(x).reshape(d, n, -1) for x in (out_BxC, lp_BxC))
        emitted, stopped = (host.local(x).reshape(d, n) for x in (emitted_B, stopped_B))
        routes_host = host.local(routes[0]).reshape(d, n, *routes[0].shape[1:]) if routes else None
        sched.accept_chunk(out, lp, emitted, stopped, routes_host)
        steps = int(steps)
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["chunks"] += 1
        self.stats["steps"] += steps
        self.stats["row_steps"] += steps * n * engine.shards


def _counts() -> dict[str, float]:
    return {"prefills": 0, "chunks": 0, "steps": 0, "row_steps": 0, "iterations": 0,
            "prefill_s": 0.0, "decode_s": 0.0}

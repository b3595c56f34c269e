"""The rollout engine's scheduler: the host state of one `Engine.generate` call, in plain
Python (tested without JAX).

Each process's requests are split over its data shards (consecutive requests, a prompt's
group, share a shard). Per shard up to `slots` requests decode while the rest wait in a
queue, and a `BlockPool` says which KV blocks are free. Every scheduling iteration:

1. `plan`: blocks for the next decode chunk of every decoding row (where the pool runs
   out, the most recently admitted rows give theirs back and wait at the head of the
   queue: recomputed by a prefill when readmitted, as vLLM does), then admission of
   queued requests into free slots with their prompt's blocks (identical prompts admitted
   together share their full blocks). It returns this process's `Needs`.
2. The engine agrees the needs of every process (one gather of `Needs`: the program
   shapes, and whether anyone prefills or decodes), runs the prefill of the admitted
   requests (`prefill_batch` -> `accept_prefill`), then one decode chunk of every live row
   (`chunk_batch` -> `accept_chunk`).

A request that finishes returns its blocks at once; `resume` may queue a follow-up in its
place (a multi-turn environment's next turn), and the pool then grows for the longer
sequences at the next `plan`.

With the prefix cache (`Limits.prefix_cache`, `rollout.prefix_cache`), a request's full
blocks stay remembered after it lets them go (finished, preempted, flushed), keyed by their
tokens and the policy version that computed them (`BlockPool.remember`): a request admitted
later whose sequence starts with them (the group's other completions, the next turn of a
multi-turn trajectory, a preempted request readmitted) holds them again and its prefill
computes only the rest (`Live.start`). Only blocks whose keys and values one version wrote
are remembered, under that version, and a request looks up only its own version's, so new
weights never read what old ones computed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np

from gpurl.config import ConfigError
from gpurl.rollout.blocks import BlockPool, blocks_needed, pool_blocks, request_blocks
from gpurl.rollout.requests import (MIN_DECODE_ROWS, MIN_PROMPT_BUCKET, MIN_ROWS, Completion,
                                    Request, bucket)

Resume = Callable[[int, Completion], "Request | None"]


@dataclass(frozen=True)
class Limits:
    """The scheduler's settings (from `rollout.*`)."""

    slots: int  # requests decoding at once per shard
    block_size: int  # tokens per KV block
    decode_chunk: int  # decode steps per device call
    kv_cache_tokens: int = 0  # pool cap per shard (0 = sized for the requests)
    prefix_cache: bool = True  # remember full blocks for later requests with the same prefix
    # a vision-language model's image soft token (-1: a text model) and one image's pixels
    # array shape, (3, H, W)
    image_token: int = -1
    image_shape: tuple[int, ...] = ()


def salt(version: int, images_key: str) -> int | str:
    """What a sequence's prefix-cache digests start from: the policy version that computed
    its keys and values, and the digest of its images (`Request.images_key`) when it has
    any, so the same tokens with other images never share a block."""
    return f"{version} {images_key}" if images_key else version


@dataclass
class Live:
    """A request on its way: its tokens so far and its blocks in its shard's pool."""

    index: int
    request: Request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)  # of tokens[0], tokens[1], ...
    versions: list[int] = field(default_factory=list)  # the policy version of each token
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens in the pool (the next token's position)
    admitted: int = -1  # admission order (the newest gives its blocks back first)
    stopped: bool = False
    start: int = 0  # tokens of the sequence found in the prefix cache at admission
    written: int = -1  # the policy version that computed the pool's keys and values of it
    clean: int = 0  # its tokens in the pool that version `written` computed (a prefix)

    @property
    def sequence(self) -> list[int]:
        return list(self.request.prompt) + self.tokens

    @property
    def key(self) -> tuple:
        """What makes two requests' sequences the same: their tokens and their images."""
        return (self.request.images_key, *self.request.prompt, *self.tokens)

    @property
    def left(self) -> int:
        return self.request.max_new_tokens - len(self.tokens)


class Shard:
    """Host state of one data shard: queued and decoding requests, its block pool."""

    def __init__(self, blocks: int, block_size: int = 1, cache: bool = False):
        self.queue: deque[Live] = deque()
        self.rows: list[Live] = []
        self.pool = BlockPool(blocks, block_size, cache)

    def release(self, live: Live) -> None:
        """The request gives its blocks back; those its version computed stay remembered."""
        if live.written >= 0:
            self.pool.remember(live.blocks, live.sequence,
                               salt(live.written, live.request.images_key),
                               min(live.clean, live.length) // self.pool.block_size)
        self.pool.release(live.blocks)
        live.blocks = []


class Needs(NamedTuple):
    """One process's needs for a scheduling iteration; `agree` combines every process's
    (the maximum of each, the sum of `queued`)."""

    blocks: int  # pool blocks its requests need now (0: no change)
    table: int  # block-table width its requests need (0: no change)
    prefill: int  # 1 when a shard admitted requests
    prompts: int  # distinct prompts per shard the prefill computes (bucketed)
    rows: int  # admitted rows per shard (bucketed)
    width: int  # the prefill's width: tokens it computes per prompt (bucketed)
    cached: int  # the prefill's prefix-cache blocks per prompt (bucketed; 0: none)
    decoding: int  # rows per shard the decode chunk steps (bucketed; 0: none)
    queued: int  # requests waiting
    images: int = 0  # image slots per prompt the prefill reads (bucketed; 0: none)

    @staticmethod
    def agree(gathered: np.ndarray) -> "Needs":
        """The iteration's agreed needs from every process's, processes x fields."""
        out = gathered.max(axis=0)
        out[Needs._fields.index("queued")] = gathered[:, Needs._fields.index("queued")].sum()
        return Needs(*(int(x) for x in out))


class Settings:
    """Per-row sampling settings of a device call (idle rows: greedy, no stop)."""

    def __init__(self, rows: int):
        self.seeds = np.zeros(rows, np.uint32)
        self.offsets = np.zeros(rows, np.int32)
        self.temperature = np.zeros(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.top_p = np.ones(rows, np.float32)
        self.stop_set = np.zeros(rows, np.int32)

    def set(self, row: int, live: Live, stop_set: int) -> None:
        r = live.request
        self.seeds[row], self.offsets[row] = np.uint32(r.seed), r.offset + len(live.tokens)
        self.temperature[row], self.top_k[row], self.top_p[row] = r.temperature, r.top_k, r.top_p
        self.stop_set[row] = stop_set

    @property
    def sampled(self) -> bool:
        return bool((self.temperature > 0).any())

    @property
    def truncate(self) -> bool:
        on = self.temperature > 0
        return bool(((self.top_k[on] > 0) | (self.top_p[on] < 1.0)).any())

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.seeds, self.offsets, self.temperature, self.top_k, self.top_p,
                self.stop_set)


class Scheduler:
    """One `generate` call's requests over `shards` data shards of this process.
    `stop_set(request)`: the index of its stop ids in the engine's device table."""

    def __init__(self, requests: Sequence[Request], limits: Limits, shards: int,
                 stop_set: Callable[[Request], int], resume: Resume | None = None,
                 prefill_width: int = 0, routes_shape: tuple[int, int] | None = None):
        for r in requests:
            check(r)
        self.limits, self.count, self.stop_set = limits, shards, stop_set
        self.resume, self.prefill_width, self.routes_shape = resume, prefill_width, routes_shape
        self.lives = [Live(i, r) for i, r in enumerate(requests)]
        self.shards: list[Shard] = []
        self.admitted: list[list[Live]] = []
        self.done: dict[int, Completion] = {}
        self.finished: list[int] = []  # indices in the order they finished
        self.version = 0  # the policy version of the tokens sampled next
        self.clock = 0  # admissions so far
        self.grown = False  # a resumed request was queued since the last `plan`
        # prefill_tokens: tokens prefills computed; sequence_tokens: tokens of the sequences
        # admitted (what prefills without any sharing would compute); cached_tokens: those
        # found in the prefix cache
        self.stats = {"preempted": 0, "live_row_steps": 0, "prefill_tokens": 0,
                      "sequence_tokens": 0, "cached_tokens": 0, "evicted": 0}

    # ------------------------------------------------------------------ the call

    def first_needs(self) -> tuple[int, int, int]:
        """(decode rows floor, block-table width, pool blocks) for the call's requests at
        their limits, before any is admitted (the engine agrees them with its peers).
        Decode batches shrink as rows finish, but not below MIN_DECODE_ROWS (fewer programs
        to compile; on CPU 8 rows cost about what 4 or 2 do) unless the call starts smaller."""
        first = min(math.ceil(len(self.lives) / self.count), self.limits.slots)
        floor = bucket(min(max(first, 1), MIN_DECODE_ROWS))
        per = self._per_shard()
        groups = [self.lives[s * per:(s + 1) * per] for s in range(self.count)] if per else [[]]
        return (floor, self._table(self.lives, self.prefill_width),
                self._pool_need(groups, self.prefill_width))

    def start(self, blocks: int) -> None:
        """Queues the requests on the shards, each with a pool of `blocks` blocks."""
        lim = self.limits
        self.shards = [Shard(blocks, lim.block_size, lim.prefix_cache) for _ in range(self.count)]
        per = self._per_shard()
        for i, live in enumerate(self.lives):
            self.shards[i // per].queue.append(live)

    def grow(self, blocks: int) -> None:
        for shard in self.shards:
            shard.pool.grow(blocks)

    def add(self, requests: Sequence[Request]) -> list[int]:
        """Queues `requests` (a prompt's group) on the shard with the fewest requests queued
        or decoding (the lowest such shard); returns their indices. The pool grows for them
        at the next `plan` if it must."""
        for r in requests:
            check(r)
        shard = min(self.shards, key=lambda s: len(s.queue) + len(s.rows))
        first = len(self.lives)
        for i, r in enumerate(requests):
            self.lives.append(Live(first + i, r))
            shard.queue.append(self.lives[-1])
        self.grown = True
        return list(range(first, len(self.lives)))

    def started(self) -> dict[int, int]:
        """The policy version of the first token of each unfinished request holding one."""
        return {x.index: x.versions[0] for shard in self.shards
                for x in [*shard.rows, *shard.queue] if x.versions}

    def drop_stale(self, oldest: int) -> int:
        """Requests holding a token sampled by a policy version below `oldest` start over
        (their tokens dropped, their blocks released, queued first; their sampling keys
        start again at their first token); returns how many."""
        dropped = 0
        for shard in self.shards:
            stale = [x for x in [*shard.rows, *shard.queue] if x.versions and x.versions[0] < oldest]
            for live in stale:
                if live in shard.rows:
                    shard.rows.remove(live)
                    shard.release(live)
                else:
                    shard.queue.remove(live)
                fresh = Live(live.index, live.request)
                self.lives[live.index] = fresh
                shard.queue.appendleft(fresh)
                dropped += 1
        return dropped

    def cancel(self, indices: set[int]) -> None:
        """The unfinished requests `indices` leave their shards (their blocks released);
        they never finish."""
        for shard in self.shards:
            for live in [x for x in shard.rows if x.index in indices]:
                shard.rows.remove(live)
                shard.release(live)
            for live in [x for x in shard.queue if x.index in indices]:
                shard.queue.remove(live)

    def flush(self) -> None:
        """Every decoding request gives its blocks back and waits at the head of its queue
        (the oldest admitted first), its tokens kept, and the prefix cache forgets every
        block: readmitted, its sequence is recomputed by a prefill. A checkpoint's state
        is then the queues alone, and a run resumed from it computes what this one does."""
        for shard in self.shards:
            for live in sorted(shard.rows, key=lambda x: x.admitted, reverse=True):
                shard.rows.remove(live)
                shard.release(live)
                shard.queue.appendleft(live)
            shard.pool.forget()

    def snapshot(self) -> dict:
        """The flushed scheduler as plain data (`load` rebuilds it)."""
        self.flush()
        return {"count": len(self.lives), "clock": self.clock, "finished": list(self.finished),
                "stats": dict(self.stats),
                "queues": [[_live_state(x) for x in shard.queue] for shard in self.shards]}

    def load(self, state: dict) -> None:
        """The state `snapshot` gave, on started shards; finished requests' completions stay
        with the caller."""
        self.lives = [Live(i, Request((0,), 1)) for i in range(state["count"])]
        self.clock, self.finished = state["clock"], list(state["finished"])
        self.stats.update(state["stats"])
        for shard, queue in zip(self.shards, state["queues"]):
            for data in queue:
                live = _live_from(data)
                self.lives[live.index] = live
                shard.queue.append(live)
        self.grown = True

    def busy(self) -> bool:
        """Whether any request is queued or decoding."""
        return any(s.queue or s.rows for s in self.shards)

    def completions(self) -> list[Completion]:
        return [self.done[i] for i in range(len(self.lives))]

    def plan(self) -> Needs:
        """Grows the pools for resumed requests, reserves the next chunk's blocks, admits
        queued requests; this process's needs for the iteration."""
        blocks = table = 0
        if self.grown:  # resumed requests: longer sequences than before
            queued = [[*s.queue, *s.rows] for s in self.shards]
            table = self._table([x for s in self.shards for x in s.queue])
            blocks = self._pool_need(queued, 0)
            self.grow(blocks)
            self.grown = False
        for shard in self.shards:
            self._reserve(shard)
        self.admitted = [self._admit(s) for s in self.shards]
        for shard in self.shards:
            self.stats["evicted"] += shard.pool.evicted
            shard.pool.evicted = 0
        prompts = rows = width = cached = images = 0
        if any(self.admitted):
            prompts = bucket(max(len(_unique(a)[0]) for a in self.admitted), MIN_ROWS)
            rows = bucket(max(len(a) for a in self.admitted), MIN_ROWS)
            longest = max(len(x.sequence) - x.start for a in self.admitted for x in a)
            reused = max(x.start for a in self.admitted for x in a) // self.limits.block_size
            # a prefill from the start pads to the run's prompt width (one shape per run)
            width = bucket(max(longest, 0 if reused else self.prefill_width), MIN_PROMPT_BUCKET)
            cached = bucket(reused) if reused else 0
            images = max((len(x.request.images) for a in self.admitted for x in a
                          if self._images_after(x)), default=0)
        # rows of the next decode chunk: those decoding and the admitted ones that will
        # not have finished at their first token (unless it is a stop token)
        decoding = max(len(s.rows) + sum(x.left > 1 for x in a)
                       for s, a in zip(self.shards, self.admitted))
        return Needs(blocks, table, int(any(self.admitted)), prompts, rows, width, cached,
                     bucket(decoding) if decoding else 0, sum(len(s.queue) for s in self.shards),
                     bucket(images) if images else 0)

    def _images_after(self, live: Live) -> bool:
        """Whether the tokens a prefill computes for `live` hold image tokens."""
        return bool(live.request.images) and self.limits.image_token in live.sequence[live.start:]

    # ----------------------------------------------------------------- prefill

    def prefill_batch(self, needs: Needs, pool_blocks: int, pad_id: int) -> dict[str, np.ndarray]:
        """The prefill's host arrays (shards x rows ...) for this iteration's admissions
        at the agreed shapes: of each distinct sequence, the tokens it computes (those after
        its cached prefix), where they start, its length and its cached blocks; of each
        admitted row, where its computed tokens go in the pool (out of range: not written),
        which distinct sequence it samples from, and its sampling settings."""
        d, p, a, w, c = self.count, needs.prompts, needs.rows, needs.width, needs.cached
        block = self.limits.block_size
        drop = pool_blocks * block  # a slot past the pool: the write is dropped
        out = {"tokens": np.full((d, p, w), pad_id, np.int32),
               "starts": np.zeros((d, p), np.int32), "lengths": np.ones((d, p), np.int32),
               "cached": np.zeros((d, p, c), np.int32),
               "dest": np.full((d, a, w), drop, np.int32), "src": np.zeros((d, a), np.int32)}
        if needs.images:  # each prompt's images, and its image tokens before `starts`
            out["pixels"] = np.zeros((d, p, needs.images, *self.limits.image_shape), np.float32)
            out["image_offsets"] = np.zeros((d, p), np.int32)
        settings = Settings(d * a)
        for s, rows in enumerate(self.admitted):
            firsts, owner = _unique(rows)
            for j, live in enumerate(firsts):
                seq = live.sequence
                out["tokens"][s, j, :len(seq) - live.start] = seq[live.start:]
                out["starts"][s, j], out["lengths"][s, j] = live.start, len(seq)
                out["cached"][s, j, :live.start // block] = live.blocks[:live.start // block]
                if needs.images and self._images_after(live):
                    out["pixels"][s, j, :len(live.request.images)] = live.request.images
                    out["image_offsets"][s, j] = seq[:live.start].count(self.limits.image_token)
                self.stats["prefill_tokens"] += len(seq) - live.start
            for i, live in enumerate(rows):
                pos = np.arange(live.start, live.length)
                slots = np.asarray(live.blocks)[pos // block] * block + pos % block
                # a shared prompt's full blocks are written by its first row alone
                first = firsts[owner[i]] is live
                write = pos >= (0 if first else live.length // block * block)
                out["dest"][s, i, :len(pos)] = np.where(write, slots, drop)
                out["src"][s, i] = owner[i]
                settings.set(s * a + i, live, self.stop_set(live.request))
                self.stats["sequence_tokens"] += live.length
                self.stats["cached_tokens"] += live.start
        out["settings"] = settings
        return out

    def accept_prefill(self, tok: np.ndarray, lp: np.ndarray, stop: np.ndarray) -> None:
        """The first token of each admitted row (shards x rows): it decodes on, or is done."""
        for s, (shard, rows) in enumerate(zip(self.shards, self.admitted)):
            for i, live in enumerate(rows):
                live.written, live.clean = self.version, live.length
                shard.pool.remember(live.blocks, live.sequence,
                                    salt(self.version, live.request.images_key),
                                    live.length // self.limits.block_size)
                live.tokens.append(int(tok[s, i]))
                live.logprobs.append(float(lp[s, i]))
                live.versions.append(self.version)
                live.stopped = bool(stop[s, i])
                if live.stopped or live.left == 0:
                    self._finish(shard, live)
                else:
                    shard.rows.append(live)
        self.admitted = []

    # ------------------------------------------------------------------ decode

    def chunk_batch(self, rows: int, width: int) -> dict[str, np.ndarray]:
        """The decode chunk's host arrays (shards x rows ...): each live row's block table
        (`width` wide), last token, length and tokens left, whether it is live, and its
        sampling settings (offsets: its tokens drawn so far)."""
        d = self.count
        out = {"table": np.zeros((d, rows, width), np.int32),
               "state": np.zeros((3, d, rows), np.int32),  # last token, length, tokens left
               "active": np.zeros((d, rows), bool)}
        settings = Settings(d * rows)
        for s, shard in enumerate(self.shards):
            for i, live in enumerate(shard.rows):
                out["table"][s, i, :len(live.blocks)] = live.blocks
                out["state"][:, s, i] = (live.tokens[-1], live.length, live.left)
                settings.set(s * rows + i, live, self.stop_set(live.request))
            out["active"][s, :len(shard.rows)] = True
        out["settings"] = settings
        return out

    def accept_chunk(self, out: np.ndarray, lp: np.ndarray, emitted: np.ndarray,
                     stopped: np.ndarray, routes: np.ndarray | None) -> None:
        """A chunk's tokens (shards x rows x steps), how many each row emitted, whether it
        stopped, and (routing replay) the experts of the tokens it fed."""
        for s, shard in enumerate(self.shards):
            for i, live in enumerate(list(shard.rows)):
                e = int(emitted[s, i])
                self.stats["live_row_steps"] += e
                if routes is not None:  # the fed tokens: tokens[-1] and all but the last new one
                    fill = np.full(self.routes_shape, -1, np.int16)
                    live.routes += [fill] * (len(live.tokens) - 1 - len(live.routes))
                    live.routes += list(routes[s, i, :e])
                live.tokens += out[s, i, :e].tolist()
                live.logprobs += lp[s, i, :e].tolist()
                live.versions += [self.version] * e
                if live.written == self.version and live.clean == live.length:
                    live.clean += e  # this chunk's keys and values: the same version's
                live.length += e
                if stopped[s, i] or live.left == 0:
                    live.stopped = bool(stopped[s, i])
                    shard.rows.remove(live)
                    self._finish(shard, live)

    # --------------------------------------------------------------- internals

    def _per_shard(self) -> int:
        return math.ceil(len(self.lives) / self.count) if self.lives else 0

    def _blocks(self, live: Live, min_width: int = 0) -> int:
        """Blocks of a request at its limit (its prompt counted as at least `min_width`)."""
        r = live.request
        return request_blocks(max(len(r.prompt), min_width) + r.max_new_tokens,
                              self.limits.block_size)

    def _table(self, lives: Sequence[Live], min_width: int = 0) -> int:
        return bucket(max((self._blocks(x, min_width) for x in lives), default=1))

    def _pool_need(self, groups: Sequence[Sequence[Live]], min_width: int) -> int:
        sizes = [[self._blocks(x, min_width) for x in group] for group in groups]
        lim = self.limits
        return pool_blocks(blocks_needed(sizes, lim.slots), lim.block_size, lim.kv_cache_tokens)

    def _admit(self, shard: Shard) -> list[Live]:
        """Requests of the shard's queue that get a slot and their prompt blocks now: the
        longest prefix the cache remembers from this version is held again, not computed;
        the full blocks of identical sequences admitted together are shared (computed
        once, by the first)."""
        lim = self.limits
        admitted, shared = [], {}
        while shard.queue and len(shard.rows) + len(admitted) < lim.slots:
            live = shard.queue[0]
            seq, key = tuple(live.sequence), live.key
            full = len(seq) // lim.block_size
            if key in shared:
                held, start = shared[key]
            else:  # the last token is always computed: its logits sample the first new one
                held = shard.pool.lookup(seq, salt(self.version, live.request.images_key),
                                         (len(seq) - 1) // lim.block_size)
                start = len(held) * lim.block_size
            shard.pool.share(held)
            own = request_blocks(len(seq) + min(lim.decode_chunk, live.left), lim.block_size)
            blocks = shard.pool.take(own - len(held))
            if blocks is None:
                shard.pool.release(held)
                if not shard.rows and not admitted:
                    raise ConfigError(
                        f"the KV cache ({shard.pool.size} blocks of {lim.block_size} tokens "
                        f"per shard) cannot hold one request of {len(seq)} tokens plus a "
                        f"decode chunk; raise rollout.kv_cache_tokens (0 = sized for the "
                        f"requests) or lower rollout.decode_chunk.")
                break
            shard.queue.popleft()
            blocks = list(held) + blocks
            shared.setdefault(key, (blocks[:full], start))
            live.blocks, live.length, live.admitted = blocks, len(seq), self.clock
            live.start, live.written, live.clean = start, -1, 0
            self.clock += 1
            admitted.append(live)
        return admitted

    def _reserve(self, shard: Shard) -> None:
        """Blocks for the next chunk of every decoding row; where the pool runs out, the
        most recently admitted rows give theirs back and wait in the queue."""
        lim = self.limits
        for live in sorted(shard.rows, key=lambda x: x.admitted):
            need = (live.length + min(lim.decode_chunk, live.left) - 1) // lim.block_size + 1
            while len(live.blocks) < need and live in shard.rows:
                more = shard.pool.take(need - len(live.blocks))
                if more is not None:
                    live.blocks += more
                    break
                victim = max(shard.rows, key=lambda x: x.admitted)
                if victim is live and len(shard.rows) == 1:
                    raise ConfigError(
                        f"the KV cache ({shard.pool.size} blocks of {lim.block_size} tokens "
                        f"per shard) cannot hold one request of {live.length} tokens; raise "
                        f"rollout.kv_cache_tokens.")
                shard.rows.remove(victim)
                shard.release(victim)
                shard.queue.appendleft(victim)
                self.stats["preempted"] += 1

    def _finish(self, shard: Shard, live: Live) -> None:
        shard.release(live)
        out = Completion(np.asarray(live.tokens, np.int32), np.asarray(live.logprobs, np.float32),
                         live.stopped, self._routes(live), np.asarray(live.versions, np.int32))
        follow = self.resume(live.index, out) if self.resume else None
        if follow is None:
            self.done[live.index] = out
            self.finished.append(live.index)
        else:
            check(follow)
            shard.queue.append(Live(live.index, follow))
            self.grown = True

    def _routes(self, live: Live) -> np.ndarray | None:
        """A finished request's recorded experts, one entry per token (-1: none)."""
        if self.routes_shape is None:
            return None
        out = np.full((len(live.tokens), *self.routes_shape), -1, np.int16)
        if live.routes:
            out[:len(live.routes)] = np.stack(live.routes)[:len(live.tokens)]
        return out


def _live_state(live: Live) -> dict:
    r = live.request
    return {"index": live.index, "admitted": live.admitted, "tokens": list(live.tokens),
            "logprobs": list(live.logprobs), "versions": list(live.versions),
            "routes": [x.tolist() for x in live.routes], "request": r.state()}


def _live_from(data: dict) -> Live:
    return Live(data["index"], Request.from_state(data["request"]), list(data["tokens"]), list(data["logprobs"]),
                [np.asarray(x, np.int16) for x in data["routes"]], list(data["versions"]),
                admitted=data["admitted"])


def check(r: Request) -> None:
    """One sentence for a request the engine cannot run."""
    if not r.prompt:
        raise ConfigError("a prompt is empty; every prompt needs at least one token.")
    if r.max_new_tokens < 1:
        raise ConfigError(f"a request asks for max_new_tokens={r.max_new_tokens}; ask for at least 1.")


def _unique(rows: list[Live]) -> tuple[list[Live], list[int]]:
    """(the first request of each distinct sequence, each request's index among them)."""
    first: dict[tuple, int] = {}
    firsts, owner = [], []
    for live in rows:
        if live.key not in first:
            first[live.key] = len(firsts)
            firsts.append(live)
        owner.append(first[live.key])
    return firsts, owner

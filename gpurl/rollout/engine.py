"""The rollout engine: continuous batching over decode slots with a paged KV cache.

Every caller's generation goes through `Engine.generate`: RL rounds and pass@k evaluation
(`rounds.RolloutEngine`), `gpurl generate`, and multi-turn environments (`resume`). Each
process's engine serves only its own requests, split over its data shards; per shard a
host scheduler keeps up to `rollout.slots` requests decoding and a queue of the rest.

The device runs two jitted programs on fixed shapes: `prefill` (the prompts of newly
admitted requests, batched, written into the KV pool; the first token sampled) and
`chunk` (up to `rollout.decode_chunk` decode steps of every live row). A chunk returns
early once enough rows finished for the host to refill their slots, or once half of
the rows are done, so the next chunk can run on half as many rows (not below
`MIN_DECODE_ROWS` unless the call starts smaller): no step is spent on a row that is
done beyond the chunk it finished in. Shapes are bucketed to powers of
two (rows, prompt width, block-table width, pool size), so a run compiles few programs
(`num_compiles`).

The KV cache is a pool of blocks of `rollout.block_size` tokens per shard
(`gpurl.kernels.paged_attention`): a request holds blocks only for the tokens it has
(allocated a chunk ahead), the G completions of one prompt share the prompt's full
blocks, and a finished request's blocks return to the pool at once. The pool is sized
for the call's requests at their own limits, capped by `rollout.kv_cache_tokens`; when
the cap is reached the most recently admitted request gives its blocks back and is
admitted again later with its tokens so far (recomputed by a prefill), as vLLM does.

A request's tokens do not depend on what shares its batch or which slot it lands in: its
sampling keys are fold_in(key(seed), i) for its i-th token (as `sampler.Sampler`, the
static reference, draws them), every row's arithmetic is its own, fully masked KV blocks
leave the attention's running sums exactly unchanged. Log-probs agree to float32
rounding: XLA's CPU matmul picks its kernel by the row count (measured: a 640-wide
projection gives bit-equal rows for 2..32 rows, but not for 1 row or from 64 rows on), so
a batch of another size can move their last bit. A decode batch of one row is kept for
its speed (the one-row head matmul of Gemma 3's 262k vocabulary takes 22 ms on this CPU,
two rows 36 ms). Log-probs are those of the distribution sampled from before top-k /
top-p truncation (`sampling.sample_rows`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gpurl.config import ConfigError, RolloutConfig
from gpurl.data import packing
from gpurl.distributed import runtime
from gpurl.distributed.mesh import Rules, replicated, tree_shardings
from gpurl.models import moe
from gpurl.kernels.attention import resolve as resolve_attention
from gpurl.kernels.platform import sampling_compiler_options
from gpurl.models.layers import sharded_rows
from gpurl.models.spec import ModelSpec, Params, serve
from gpurl.models.transformer import PagedKV, compute_dtype
from gpurl.rollout.decode import local_rows
from gpurl.rollout.sampling import sample_rows

MIN_PROMPT_BUCKET = 16
MIN_ROWS = 2  # prefill rows: XLA's one-row matmul rounds differently from its batched one
MIN_DECODE_ROWS = 8


def bucket(n: int, minimum: int = 1) -> int:
    """Next power of two >= max(n, minimum): O(log n) distinct shapes over a run."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@flax.struct.dataclass
class Rollout:
    """Completions of a batch; every array is sharded over the rollout data axis."""

    tokens: jax.Array  # B x N int32: sampled tokens, pad after the stop
    lengths: jax.Array  # B int32: tokens generated, the stop token included
    logprobs: jax.Array  # B x N float32: log-prob of each sampled token, 0 after the stop
    routes: jax.Array | None = None  # B x N x L x k int16: routing replay's experts (Completion.routes)
    # B x N float32: 1 on the model's own tokens, 0 on a multi-turn trajectory's
    # observation tokens (never trained); None = every token up to the length is the model's
    mask: jax.Array | None = None


@dataclass(frozen=True)
class Request:
    """One completion to generate. `offset`: tokens already drawn for this completion
    before (a resumed request), so its sampling keys continue where they stopped."""

    prompt: tuple[int, ...]  # token ids, BOS included
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = all tokens
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] | None = None  # None: the engine's (EOS + rollout.stop)
    offset: int = 0


@dataclass
class Completion:
    tokens: np.ndarray  # int32: generated tokens, the stop token included
    logprobs: np.ndarray  # float32: log-prob of each under the distribution sampled from
    stopped: bool  # ended on a stop id (else at max_new_tokens)
    # routing replay: the experts each token was routed to when it was fed back in
    # (N x L sparse layers x k, int16; -1 where none was recorded: the last token, and
    # tokens a recompute or resume prefill fed); None unless model.moe.replay_routing
    routes: np.ndarray | None = None


@dataclass
class _Live:
    """A request on its way: its tokens so far and its blocks in its shard's pool."""

    index: int
    request: Request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[np.ndarray] = field(default_factory=list)  # of tokens[0], tokens[1], ...
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens in the pool (the next token's position)
    admitted: int = -1  # admission order (the newest gives its blocks back first)
    stopped: bool = False

    @property
    def sequence(self) -> list[int]:
        return list(self.request.prompt) + self.tokens

    @property
    def left(self) -> int:
        return self.request.max_new_tokens - len(self.tokens)


class _Shard:
    """Host state of one data shard: queued and decoding requests, the free blocks."""

    def __init__(self, blocks: int):
        self.queue: deque[_Live] = deque()
        self.rows: list[_Live] = []
        self.free = list(range(blocks - 1, 0, -1))  # block 0 takes idle rows' writes
        self.refs = np.zeros(blocks, np.int32)

    def grow(self, blocks: int) -> None:
        """The pool now has `blocks` blocks (the old ones kept in place)."""
        old = len(self.refs)
        if blocks > old:
            self.free = list(range(blocks - 1, old - 1, -1)) + self.free
            self.refs = np.concatenate([self.refs, np.zeros(blocks - old, np.int32)])

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = [self.free.pop() for _ in range(n)]
        self.refs[out] = 1
        return out

    def release(self, live: _Live) -> None:
        for blk in live.blocks:
            self.refs[blk] -= 1
            if self.refs[blk] == 0:
                self.free.append(blk)
        live.blocks = []


class Generator:
    """What every generator on the rollout mesh (data, tp) holds: the model, its sampling
    layout, the row sharding, the stop ids and the padding id."""

    def __init__(self, spec: ModelSpec, cfg: RolloutConfig, mesh: Mesh, rules: Rules, *,
                 stop_ids: Sequence[int], pad_id: int):
        self.spec, self.cfg, self.mesh = spec, cfg, mesh
        # `stacked_shardings`: the stored parameters laid out for sampling (to load them);
        # `abstract_params`: the parameters as the programs read them, in the compute
        # dtype, unrolled layers apart (`ModelSpec.serving_params`)
        self.stacked_shardings = tree_shardings(spec.abstract_params, spec.logical_axes, rules, mesh)
        self.abstract_params = spec.serving_params(self.stacked_shardings)
        self.param_shardings = jax.tree.map(lambda a: a.sharding, self.abstract_params)
        self.rows = NamedSharding(mesh, P("data"))
        self.rules = rules
        self.stop_ids = tuple(sorted(set(stop_ids)))
        self.pad_id = pad_id

    def traced(self, fn: Callable) -> Callable:
        """`fn` tracing the model with its rows and parameter layout known, which a
        mixture-of-experts model needs to run its experts where their weights live
        (`gpurl.models.moe`) and the Pallas attention kernels to run on each device's own
        rows (`gpurl.kernels.attention.Shards`); other programs stay as they were."""
        if not self.spec.cfg.moe.num_experts and resolve_attention(self.spec.cfg.attention) == "xla":
            return fn

        @functools.wraps(fn)
        def inside(*args: Any) -> Any:
            with sharded_rows(self.rows, self.rules):
                return fn(*args)
        return inside

    def place(self, params: Params) -> Params:
        """Parameters in the sampling layout and dtypes (a no-op when they already are):
        cast where they lie, then laid out, so no full-precision copy reaches the rollout
        mesh and no program converts a weight while it decodes."""
        return jax.device_put(serve(params, self.abstract_params), self.param_shardings)


class Engine(Generator):
    """Generates completions of requests on the rollout mesh (data, tp)."""

    def __init__(self, spec: ModelSpec, cfg: RolloutConfig, mesh: Mesh, rules: Rules, *,
                 stop_ids: Sequence[int], pad_id: int):
        super().__init__(spec, cfg, mesh, rules, stop_ids=stop_ids, pad_id=pad_id)
        self.shards = mesh.shape["data"]
        self.local_shards = max(self.shards // jax.process_count(), 1)
        self.block = cfg.block_size
        m = spec.cfg
        heads = "tp" if m.num_kv_heads % mesh.shape["tp"] == 0 else None
        self.pool_sharding = NamedSharding(mesh, P("data", None, None, None, heads, None))
        self._pool_shape = (m.num_layers, m.num_kv_heads, m.head_dim)
        self._pool: tuple[jax.Array, jax.Array] | None = None
        self._stop_sets: dict[tuple[int, ...], int] = {}
        self._stop_table: jax.Array | None = None
        self._stop_set(None)
        experts = spec.cfg.moe
        # (sparse layers, experts per token) recorded per decoded token, or None
        self.routes_shape = ((sum(experts.is_sparse(i) for i in range(m.num_layers)),
                              experts.experts_per_token)
                             if experts.num_experts and experts.replay_routing else None)
        options = sampling_compiler_options()
        self._prefill = jax.jit(self.traced(self._prefill_fn), static_argnums=(0,),
                                donate_argnums=(2, 3), compiler_options=options)
        self._chunk = jax.jit(self.traced(self._chunk_fn), static_argnums=(0,),
                              donate_argnums=(2, 3), compiler_options=options)
        self._compiled: dict[tuple, object] = {}  # ahead-of-time programs (the memory plan's)
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------ public

    def num_compiles(self) -> int:
        return self._prefill._cache_size() + self._chunk._cache_size()

    def request(self, prompt: Sequence[int], seed: int, max_new_tokens: int | None = None,
                temperature: float | None = None) -> Request:
        """A request with the configured settings, some overridden."""
        return Request(tuple(int(t) for t in prompt), max_new_tokens or self.cfg.max_new_tokens,
                       self.cfg.temperature if temperature is None else temperature,
                       self.cfg.top_k, self.cfg.top_p, int(seed))

    def generate(self, params: Params, requests: Sequence[Request],
                 resume: Callable[[int, Completion], Request | None] | None = None,
                 prefill_width: int = 0) -> list[Completion]:
        """Completions of this process's `requests`, in order. `resume(i, completion)` is
        called as request i finishes; a Request it returns (e.g. the completion plus an
        environment's reply appended to the prompt) is queued in its place, and the last
        completion of each index is returned. `prefill_width`: pad prefills to at least
        this many tokens (RL: one prefill shape per run). Every process must call this
        together."""
        for r in requests:
            self._check(r)
        params = self.place(params)
        lives = [_Live(i, r) for i, r in enumerate(requests)]
        width = self._table_width(lives, prefill_width)
        # Decode batches shrink as rows finish, but not below MIN_DECODE_ROWS (fewer
        # programs to compile; on CPU 8 rows cost about what 4 or 2 do) unless the call
        # starts smaller.
        first = min(math.ceil(len(lives) / self.local_shards), self.cfg.slots)
        self._floor = self._agree_max(bucket(min(max(first, 1), MIN_DECODE_ROWS)))
        shards = [_Shard(self._ensure_pool(lives, prefill_width)) for _ in range(self.local_shards)]
        per = math.ceil(len(lives) / self.local_shards) if lives else 0
        for i, live in enumerate(lives):  # consecutive requests (a prompt's group) share a shard
            shards[i // per].queue.append(live)
        done: dict[int, Completion] = {}
        self.stats = {"prefills": 0, "chunks": 0, "steps": 0, "row_steps": 0,
                      "live_row_steps": 0, "preempted": 0, "prefill_s": 0.0, "decode_s": 0.0}
        started = time.perf_counter()
        clock = [0]

        def finish(shard: _Shard, live: _Live) -> None:
            shard.release(live)
            out = Completion(np.asarray(live.tokens, np.int32),
                             np.asarray(live.logprobs, np.float32), live.stopped,
                             self._routes(live))
            follow = resume(live.index, out) if resume else None
            if follow is None:
                done[live.index] = out
            else:
                self._check(follow)
                shard.queue.append(_Live(live.index, follow))
                grown[0] = True

        grown = [False]
        while True:
            if self._agree_any(grown[0]):  # resumed requests: longer sequences than before
                queued = [x for s in shards for x in s.queue]
                width = max(width, self._table_width(queued))
                blocks = self._ensure_pool(queued + [x for s in shards for x in s.rows], 0)
                for shard in shards:
                    shard.grow(blocks)
                grown[0] = False
            admitted = [self._admit(s, clock) for s in shards]
            if self._agree_any(any(admitted)):
                self._run_prefill(params, shards, admitted, prefill_width, finish)
            self._reserve(shards)
            if not self._agree_any(any(s.rows for s in shards)):
                if not self._agree_any(any(s.queue for s in shards)):
                    break
                continue
            self._run_chunk(params, shards, width, finish)
        self.stats["host_s"] = (time.perf_counter() - started - self.stats["prefill_s"]
                                - self.stats["decode_s"])
        return [done[i] for i in range(len(requests))]

    def compile_round(self, rows: int, width: int, group: int) -> tuple[list, float]:
        """The programs of a round of `rows` requests per process (prompts of up to
        `width` tokens, runs of `group` identical ones, rollout.max_new_tokens each) at
        their largest shapes, compiled ahead of time from abstract arrays (the round then
        dispatches them); returns (the compiled programs, the KV pool's bytes per device)."""
        out = []
        for _, fn, (static, *args) in self.round_programs(rows, width, group):
            compiled = fn.lower(static, *args).compile()
            self._compiled[self._key(fn, static, args)] = compiled
            out.append(compiled)
        pool = self._round_pool(rows, width)
        per_device = self.pool_sharding.shard_shape(pool.shape)
        return out, 2.0 * math.prod(per_device) * pool.dtype.itemsize

    def _round_pool(self, rows: int, width: int) -> jax.ShapeDtypeStruct:
        """The KV pool (keys or values) of a round of `rows` requests per process."""
        live = min(-(-rows // self.local_shards), self.cfg.slots)
        blocks = -(-(width + self.cfg.max_new_tokens) // self.block)
        layers, kv, e = self._pool_shape
        return jax.ShapeDtypeStruct(
            (self.shards, layers, self._pool_blocks(live * blocks), self.block, kv, e),
            compute_dtype(self.spec.cfg), sharding=self.pool_sharding)

    def round_rows(self, rows: int, group: int) -> tuple[int, int, int]:
        """Rows per data shard of a round of `rows` requests per process (runs of `group`
        identical prompts) at its largest: (distinct prompts a prefill computes, rows it
        admits, rows a decode chunk steps)."""
        live = min(-(-rows // self.local_shards), self.cfg.slots)
        return bucket(-(-live // group), MIN_ROWS), bucket(live, MIN_ROWS), bucket(live)

    def round_programs(self, rows: int, width: int, group: int) -> list[tuple[str, Any, tuple]]:
        """(name, jitted function, abstract arguments) of the prefill and the decode chunk
        of such a round at their largest shapes (`compile_round` compiles them; the CUDA
        lowering tests lower them)."""
        blocks = -(-(width + self.cfg.max_new_tokens) // self.block)
        pool = self._round_pool(rows, width)
        params = self.abstract_params
        stops = jax.ShapeDtypeStruct((1, self.spec.cfg.vocab_size), jnp.bool_,
                                     sharding=replicated(self.mesh))
        rows_of = lambda count, *shape, dt=jnp.int32: jax.ShapeDtypeStruct(  # noqa: E731
            (self.shards * count, *shape), dt, sharding=self.rows)
        sampled = self.cfg.temperature > 0
        truncate = sampled and (self.cfg.top_k > 0 or self.cfg.top_p < 1.0)

        def settings(count):
            return (rows_of(count, dt=jnp.uint32), rows_of(count), rows_of(count, dt=jnp.float32),
                    rows_of(count), rows_of(count, dt=jnp.float32), rows_of(count))

        p, a, c = self.round_rows(rows, group)
        w = bucket(width, MIN_PROMPT_BUCKET)
        prefill_args = (params, pool, pool, rows_of(p, w), rows_of(p), rows_of(a, w), rows_of(a),
                        *settings(a), stops)
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        chunk_args = (params, pool, pool, rows_of(c, bucket(blocks)), *(rows_of(c) for _ in range(3)),
                      rows_of(c, dt=jnp.bool_), *settings(c), stops, scalar, scalar, scalar)
        return [("rollout prefill", self._prefill, ((sampled, truncate), *prefill_args)),
                ("rollout decode chunk", self._chunk,
                 ((sampled, truncate, self.cfg.decode_chunk), *chunk_args))]

    # --------------------------------------------------------------- scheduling

    def _check(self, r: Request) -> None:
        if not r.prompt:
            raise ConfigError("a prompt is empty; every prompt needs at least one token.")
        if r.max_new_tokens < 1:
            raise ConfigError(f"a request asks for max_new_tokens={r.max_new_tokens}; ask for at least 1.")

    def _blocks(self, live: _Live, min_width: int = 0) -> int:
        """Blocks of a request at its limit (its prompt counted as at least `min_width`)."""
        r = live.request
        return -(-(max(len(r.prompt), min_width) + r.max_new_tokens) // self.block)

    def _table_width(self, lives: Sequence[_Live], min_width: int = 0) -> int:
        longest = max((self._blocks(x, min_width) for x in lives), default=1)
        return self._agree_max(bucket(longest))

    def _pool_blocks(self, need: int) -> int:
        """Pool blocks for `need` blocks of requests: capped by rollout.kv_cache_tokens,
        plus block 0 (idle rows' writes), rounded up to three significant bits (at most
        25% over: few pool shapes to compile, where a power of two could double the
        largest allocation of a rollout)."""
        if self.cfg.kv_cache_tokens:
            need = min(need, -(-self.cfg.kv_cache_tokens // self.block))
        return packing.bucket(need + 1)

    def _ensure_pool(self, lives: Sequence[_Live], min_width: int) -> int:
        """Blocks per shard for these requests at their limits (the `slots` largest of a
        shard in flight at once), capped by rollout.kv_cache_tokens; (re)allocates the pool
        when it is smaller. Returns the pool's blocks."""
        per = math.ceil(len(lives) / self.local_shards) if lives else 1
        need = 0
        for start in range(0, max(len(lives), 1), per):
            sizes = sorted((self._blocks(x, min_width) for x in lives[start:start + per]),
                           reverse=True)
            need = max(need, sum(sizes[:self.cfg.slots]))
        blocks = self._agree_max(self._pool_blocks(need))
        if self._pool is None:
            layers, kv, e = self._pool_shape
            shape = (self.shards, layers, blocks, self.block, kv, e)
            dtype = compute_dtype(self.spec.cfg)
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=self.pool_sharding)
            self._pool = (zeros(), zeros())
        elif self._pool[0].shape[2] < blocks:  # grown in place: live blocks keep their ids
            extra = blocks - self._pool[0].shape[2]
            pad = jax.jit(lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra)) + ((0, 0),) * 3),
                          out_shardings=self.pool_sharding, donate_argnums=0)
            self._pool = tuple(pad(x) for x in self._pool)
        return self._pool[0].shape[2]

    def _admit(self, shard: _Shard, clock: list[int]) -> list[_Live]:
        """Requests of the shard's queue that get a slot and their prompt blocks now; the
        full blocks of identical prompts admitted together are shared."""
        admitted, shared = [], {}
        while shard.queue and len(shard.rows) + len(admitted) < self.cfg.slots:
            live = shard.queue[0]
            seq = tuple(live.sequence)
            full = len(seq) // self.block
            reuse = shared.get(seq)
            own = -(-(len(seq) + min(self.cfg.decode_chunk, live.left)) // self.block)
            own -= full if reuse is not None else 0
            blocks = shard.take(own)
            if blocks is None:
                if not shard.rows and not admitted:
                    raise ConfigError(
                        f"the KV cache ({len(shard.refs) - 1} blocks of {self.block} tokens "
                        f"per shard) cannot hold one request of {len(seq)} tokens plus a "
                        f"decode chunk; raise rollout.kv_cache_tokens (0 = sized for the "
                        f"requests) or lower rollout.decode_chunk.")
                break
            shard.queue.popleft()
            if reuse is not None:
                shard.refs[reuse] += 1
                blocks = list(reuse) + blocks
            else:
                shared[seq] = blocks[:full]
            live.blocks, live.length, live.admitted = blocks, len(seq), clock[0]
            clock[0] += 1
            admitted.append(live)
        return admitted

    def _reserve(self, shards: list[_Shard]) -> None:
        """Blocks for the next chunk of every decoding row; where the pool runs out, the
        most recently admitted rows give theirs back and wait in the queue."""
        for shard in shards:
            for live in sorted(shard.rows, key=lambda x: x.admitted):
                need = (live.length + min(self.cfg.decode_chunk, live.left) - 1) // self.block + 1
                while len(live.blocks) < need and live in shard.rows:
                    more = shard.take(need - len(live.blocks))
                    if more is not None:
                        live.blocks += more
                        break
                    victim = max(shard.rows, key=lambda x: x.admitted)
                    if victim is live and len(shard.rows) == 1:
                        raise ConfigError(
                            f"the KV cache ({len(shard.refs) - 1} blocks of {self.block} "
                            f"tokens per shard) cannot hold one request of {live.length} "
                            f"tokens; raise rollout.kv_cache_tokens.")
                    shard.rows.remove(victim)
                    shard.release(victim)
                    shard.queue.appendleft(victim)
                    self.stats["preempted"] += 1

    # ------------------------------------------------------------ multi-process

    def _agree_max(self, value: int) -> int:
        return max(runtime.gather_ints(value))

    def _agree_sum(self, value: int) -> int:
        return sum(runtime.gather_ints(value))

    def _agree_any(self, flag: bool) -> bool:
        return self._agree_max(int(bool(flag))) > 0

    def _global(self, local: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.rows, local)

    # ------------------------------------------------------------------ prefill

    def _run_prefill(self, params: Params, shards: list[_Shard], admitted: list[list[_Live]],
                     min_width: int, finish: Callable[[_Shard, _Live], None]) -> None:
        groups = [_unique(a) for a in admitted]
        p = self._agree_max(bucket(max(len(g[0]) for g in groups), MIN_ROWS))
        a = self._agree_max(bucket(max(len(x) for x in admitted), MIN_ROWS))
        longest = max((len(x.sequence) for s in admitted for x in s), default=1)
        w = self._agree_max(bucket(max(longest, min_width), MIN_PROMPT_BUCKET))
        y = self._pool[0].shape[2]
        tokens = np.full((len(shards), p, w), self.pad_id, np.int32)
        lengths = np.ones((len(shards), p), np.int32)
        dest = np.full((len(shards), a, w), y * self.block, np.int32)  # out of range: dropped
        src = np.zeros((len(shards), a), np.int32)
        settings = _Settings(len(shards) * a)
        for d, (rows, (firsts, owner)) in enumerate(zip(admitted, groups)):
            for j, live in enumerate(firsts):
                seq = live.sequence
                tokens[d, j, :len(seq)] = seq
                lengths[d, j] = len(seq)
            for i, live in enumerate(rows):
                seq_len = live.length
                pos = np.arange(seq_len)
                slots = np.asarray(live.blocks)[pos // self.block] * self.block + pos % self.block
                first = firsts[owner[i]] is live
                write = pos >= (0 if first else seq_len // self.block * self.block)
                dest[d, i, :seq_len] = np.where(write, slots, y * self.block)
                src[d, i] = owner[i]
                settings.set(d * a + i, live, self._stop_set(live.request))
        static = (settings.sampled, settings.truncate)
        k, v = self._pool
        args = (params, k, v, *(self._global(x.reshape(-1, *x.shape[2:]))
                                for x in (tokens, lengths, dest, src)),
                *settings.arrays(self._global), self._stops())
        t0 = time.perf_counter()
        k, v, tok_B, lp_B, stop_B = self._program(self._prefill, static, args)
        self._pool = (k, v)
        tok, lp, stop = (_local(x).reshape(len(shards), a) for x in (tok_B, lp_B, stop_B))
        self.stats["prefills"] += 1
        self.stats["prefill_s"] += time.perf_counter() - t0
        for d, (shard, rows) in enumerate(zip(shards, admitted)):
            for i, live in enumerate(rows):
                live.tokens.append(int(tok[d, i]))
                live.logprobs.append(float(lp[d, i]))
                live.stopped = bool(stop[d, i])
                if live.stopped or live.left == 0:
                    finish(shard, live)
                else:
                    shard.rows.append(live)

    def _prefill_fn(self, static, params, k_pool, v_pool, tokens_BxW, lengths_B, dest_BxW,
                    src_B, seeds_B, offsets_B, temperature_B, top_k_B, top_p_B, stop_set_B,
                    stop_table):
        sampled, truncate = static
        a = self.shards
        b, w = tokens_BxW.shape
        positions_BxW = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
        segments_BxW = (positions_BxW < lengths_B[:, None]).astype(jnp.int32)
        hidden_BxWxD, kv = self.spec.prompt_kv(params, tokens_BxW, positions_BxW, segments_BxW, 1)
        last_BxD = jnp.take_along_axis(hidden_BxWxD, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        logits_BxV = self.spec.logits(params, last_BxD)
        def shard(k_LxYxUxKxE, v_LxYxUxKxE, new_k, new_v, logits_PxV, src_B, dest_BxW):
            l, y, u = k_LxYxUxKxE.shape[:3]

            def write(pool, new_LxPxWxKxE):
                flat = pool.reshape(l, y * u, *pool.shape[3:])
                flat = flat.at[:, dest_BxW].set(new_LxPxWxKxE[:, src_B].astype(pool.dtype),
                                                mode="drop")
                return flat.reshape(pool.shape)

            return write(k_LxYxUxKxE, new_k), write(v_LxYxUxKxE, new_v), logits_PxV[src_B]

        k_pool, v_pool, logits_BxV = jax.vmap(shard)(
            k_pool, v_pool, _shards_second(kv.k, a), _shards_second(kv.v, a),
            _shards_first(logits_BxV, a), _shards_first(src_B, a), _shards_first(dest_BxW, a))
        logits_BxV = logits_BxV.reshape(-1, logits_BxV.shape[-1])
        keys_B = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.key)(seeds_B), offsets_B)
        tok_B, lp_B = sample_rows(logits_BxV, keys_B, temperature_B, top_k_B, top_p_B,
                                  sampled, truncate)
        return k_pool, v_pool, tok_B, lp_B, stop_table[stop_set_B, tok_B]

    # -------------------------------------------------------------------- decode

    def _run_chunk(self, params: Params, shards: list[_Shard], width: int,
                   finish: Callable[[_Shard, _Live], None]) -> None:
        live_rows = [len(s.rows) for s in shards]
        n = max(self._agree_max(bucket(max(live_rows))), self._floor)
        queued = self._agree_sum(sum(len(s.queue) for s in shards))
        active = self._agree_sum(sum(live_rows))
        # Return when the queue can refill enough slots (all shards' rows), or when every
        # shard has at most half its rows left (the next chunk runs on half as many).
        refill = active - min(queued, max(1, self.cfg.slots // 4)) if queued else 0
        halve = n // 2 if n > self._floor else 0
        table = np.zeros((len(shards), n, width), np.int32)
        state = np.zeros((3, len(shards), n), np.int32)  # last token, length, tokens left
        settings = _Settings(len(shards) * n)  # its offsets: each row's tokens drawn so far
        active_B = np.zeros((len(shards), n), bool)
        longest = 0
        for d, shard in enumerate(shards):
            for i, live in enumerate(shard.rows):
                table[d, i, :len(live.blocks)] = live.blocks
                state[:, d, i] = (live.tokens[-1], live.length, live.left)
                settings.set(d * n + i, live, self._stop_set(live.request))
                longest = max(longest, live.length)
            active_B[d, :len(shard.rows)] = True
        longest = self._agree_max(longest)
        static = (settings.sampled, settings.truncate, self.cfg.decode_chunk)
        k, v = self._pool
        g = self._global
        args = (params, k, v, g(table.reshape(-1, width)),
                *(g(x.reshape(-1)) for x in state), g(active_B.reshape(-1)),
                *settings.arrays(g), self._stops(), np.int32(longest), np.int32(refill),
                np.int32(halve))
        t0 = time.perf_counter()
        k, v, out_BxC, lp_BxC, emitted_B, stopped_B, steps, *routes_out = self._program(
            self._chunk, static, args)
        self._pool = (k, v)
        routes = _local(routes_out[0]).reshape(len(shards), n, *routes_out[0].shape[1:]) \
            if routes_out else None
        out, lp = (_local(x).reshape(len(shards), n, -1) for x in (out_BxC, lp_BxC))
        emitted, stopped = (_local(x).reshape(len(shards), n) for x in (emitted_B, stopped_B))
        steps = int(steps)
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["chunks"] += 1
        self.stats["steps"] += steps
        self.stats["row_steps"] += steps * n * self.shards
        for d, shard in enumerate(shards):
            for i, live in enumerate(list(shard.rows)):
                e = int(emitted[d, i])
                self.stats["live_row_steps"] += e
                if routes is not None:  # the fed tokens: tokens[-1] and all but the last new one
                    fill = np.full(self.routes_shape, -1, np.int16)
                    live.routes += [fill] * (len(live.tokens) - 1 - len(live.routes))
                    live.routes += list(routes[d, i, :e])
                live.tokens += out[d, i, :e].tolist()
                live.logprobs += lp[d, i, :e].tolist()
                live.length += e
                if stopped[d, i] or live.left == 0:
                    live.stopped = bool(stopped[d, i])
                    shard.rows.remove(live)
                    finish(shard, live)

    def _chunk_fn(self, static, params, k_pool, v_pool, table_BxI, last_B, lengths_B,
                  left_B, active_B, seeds_B, drawn_B, temperature_B, top_k_B,
                  top_p_B, stop_set_B, stop_table, longest, refill, halve):
        sampled, truncate, steps = static
        b = last_B.shape[0]
        keys_B = jax.vmap(jax.random.key)(seeds_B)
        ones_Bx1 = jnp.ones((b, 1), jnp.int32)

        width = table_BxI.shape[1]

        def cond(state):
            step, active_B = state[0], state[7]
            per_shard = jnp.sum(active_B.reshape(self.shards, -1), axis=1)
            return (step < steps) & (jnp.sum(per_shard) > refill) & (jnp.max(per_shard) > halve)

        def body(state):
            (step, k, v, last_B, lengths_B, drawn_B, left_B, active_B, out_BxC, lp_BxC,
             emitted_B, stopped_B, *routes_out) = state
            live = jnp.minimum((longest + step) // self.block + 1, width)
            cache = PagedKV(k, v, table_BxI, lengths_B, live)
            with moe.chosen_experts() if routes_out else contextlib.nullcontext([]) as chosen:
                hidden_Bx1xD, cache = self.spec.hidden(params, last_B[:, None], lengths_B[:, None],
                                                       ones_Bx1, cache)
            if routes_out:  # L x B x 1 x k: the experts of the token fed at this step
                fed = jnp.moveaxis(chosen[0][:, :, 0], 0, 1).astype(jnp.int16)
                routes_out = [routes_out[0].at[:, step].set(
                    jnp.where(active_B[:, None, None], fed, -1))]
            logits_BxV = self.spec.logits(params, hidden_Bx1xD[:, 0])
            tok_B, lp_B = sample_rows(logits_BxV, jax.vmap(jax.random.fold_in)(keys_B, drawn_B),
                                      temperature_B, top_k_B, top_p_B, sampled, truncate)
            out_BxC = out_BxC.at[:, step].set(jnp.where(active_B, tok_B, self.pad_id))
            lp_BxC = lp_BxC.at[:, step].set(jnp.where(active_B, lp_B, 0.0))
            step_B = active_B.astype(jnp.int32)
            left_B = left_B - step_B
            stop_B = stop_table[stop_set_B, tok_B] & active_B
            return (step + 1, cache.k, cache.v, jnp.where(active_B, tok_B, last_B),
                    lengths_B + step_B, drawn_B + step_B, left_B,
                    active_B & ~stop_B & (left_B > 0), out_BxC, lp_BxC, emitted_B + step_B,
                    stopped_B | stop_B, *routes_out)

        init = (jnp.int32(0), k_pool, v_pool, last_B, lengths_B, drawn_B, left_B, active_B,
                jnp.full((b, steps), self.pad_id, jnp.int32), jnp.zeros((b, steps), jnp.float32),
                jnp.zeros(b, jnp.int32), jnp.zeros(b, bool))
        if self.routes_shape is not None:
            init += (jnp.full((b, steps, *self.routes_shape), -1, jnp.int16),)
        state = jax.lax.while_loop(cond, body, init)
        step, k_pool, v_pool = state[:3]
        return (k_pool, v_pool, state[8], state[9], state[10], state[11], step, *state[12:])

    # ------------------------------------------------------------------ helpers

    def _routes(self, live: _Live) -> np.ndarray | None:
        """A finished request's recorded experts, one entry per token (-1: none)."""
        if self.routes_shape is None:
            return None
        out = np.full((len(live.tokens), *self.routes_shape), -1, np.int16)
        if live.routes:
            out[:len(live.routes)] = np.stack(live.routes)[:len(live.tokens)]
        return out

    def _stop_set(self, r: Request | None) -> int:
        """Index of the request's stop ids in the device table (V flags per set); None:
        the engine's own (every process's table starts with them)."""
        ids = self.stop_ids if r is None or r.stop_ids is None else tuple(sorted(set(r.stop_ids)))
        if ids not in self._stop_sets:
            self._stop_sets[ids] = len(self._stop_sets)
            self._stop_table = None  # rebuilt on the next call (`_stops`)
        return self._stop_sets[ids]

    def _stops(self) -> jax.Array:
        """The stop sets as a device table, built when first needed (a built engine holds
        no device memory until it generates: the memory plan's check precedes it)."""
        if self._stop_table is None:
            sets = sorted(self._stop_sets, key=self._stop_sets.get)
            table = np.zeros((bucket(len(sets)), self.spec.cfg.vocab_size), bool)
            for j, s in enumerate(sets):
                table[j, list(s)] = True
            self._stop_table = jax.device_put(table, replicated(self.mesh))
        return self._stop_table

    def _key(self, fn, static, args) -> tuple:
        shapes = tuple(tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(args[1:]))
        return fn is self._chunk, static, shapes

    def _program(self, fn, static, args):
        """The ahead-of-time program for these shapes (`compile_round`), else the jitted one."""
        compiled = self._compiled.get(self._key(fn, static, args))
        self.stats["planned_calls"] = self.stats.get("planned_calls", 0) + (compiled is not None)
        return compiled(*args) if compiled is not None else fn(static, *args)


class _Settings:
    """Per-row sampling settings of a device call (idle rows: greedy, no stop)."""

    def __init__(self, rows: int):
        self.seeds = np.zeros(rows, np.uint32)
        self.offsets = np.zeros(rows, np.int32)
        self.temperature = np.zeros(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.top_p = np.ones(rows, np.float32)
        self.stop_set = np.zeros(rows, np.int32)

    def set(self, row: int, live: _Live, stop_set: int) -> None:
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

    def arrays(self, to_global) -> tuple[jax.Array, ...]:
        return tuple(to_global(x) for x in (self.seeds, self.offsets, self.temperature,
                                             self.top_k, self.top_p, self.stop_set))


def _unique(rows: list[_Live]) -> tuple[list[_Live], list[int]]:
    """(the first request of each distinct sequence, each request's index among them)."""
    first: dict[tuple[int, ...], int] = {}
    firsts, owner = [], []
    for live in rows:
        seq = tuple(live.sequence)
        if seq not in first:
            first[seq] = len(firsts)
            firsts.append(live)
        owner.append(first[seq])
    return firsts, owner


def _shards_first(x: jax.Array, a: int) -> jax.Array:
    return x.reshape(a, x.shape[0] // a, *x.shape[1:])


def _shards_second(x: jax.Array, a: int) -> jax.Array:
    """L x B x ... -> A x L x (B / A) x ...: a layer-stacked array's rows by shard."""
    x = x.reshape(x.shape[0], a, x.shape[1] // a, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1)


def _local(x: jax.Array) -> np.ndarray:
    """This process's rows of a row-sharded array, in order (tp replicas once)."""
    return np.concatenate([rows for _, rows in local_rows(x)])

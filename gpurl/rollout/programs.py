"""The rollout engine's device side: the model as the rollout mesh runs it
(`RolloutModel`, shared with the static reference sampler) and the engine's two jitted
programs on fixed shapes (`Programs`):

- `prefill`: the prompts of newly admitted requests, batched (each distinct sequence once:
  the G completions of a prompt share it), written into the KV pool; the first token
  sampled. A sequence whose first blocks the prefix cache holds computes only the tokens
  after them, attending to those blocks' keys and values read from the pool.
- `chunk`: up to `rollout.decode_chunk` decode steps of every live row. It returns early
  once enough rows finished for the host to refill their slots (`take` rows are queued),
  or once every shard has at most half its rows left (`halve`), so the next chunk can run
  on half as many rows.

Shapes are bucketed (rows, prompt width, block-table width to powers of two, pool blocks
to three significant bits), so a run compiles few programs (`num_compiles`); a round's
programs at their largest shapes can be compiled ahead of time from abstract arrays
(`compile_round`, the memory plan's), and calls of those shapes run them. Stop ids are a
device table of V flags per stop set (`stop_set`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gpurl.config import RolloutConfig
from gpurl.distributed.mesh import Rules, replicated, tree_shardings
from gpurl.kernels.attention import resolve as resolve_attention
from gpurl.kernels.platform import sampling_compiler_options
from gpurl.models import moe
from gpurl.models.layers import sharded_rows
from gpurl.models.spec import ModelSpec, Params, serve
from gpurl.models.transformer import PagedKV, compute_dtype, init_cache
from gpurl.rollout.blocks import pool_blocks, request_blocks
from gpurl.rollout.requests import MIN_ROWS, Request, bucket, prompt_width
from gpurl.rollout.sampling import sample_rows

class RoundPrograms(NamedTuple):
    """A rollout round's two programs, each (jitted function, abstract arguments)."""

    prefill: tuple[Any, tuple]  # the round's prompts in one call
    decode: tuple[Any, tuple]  # the decode chunk: rollout.decode_chunk tokens of every row


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



class RolloutModel:
    """The model as the rollout mesh (data, tp) runs it: its sampling layout, the row
    sharding, the stop ids and the padding id (the engine's and the static sampler's)."""

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



class Programs(RolloutModel):
    """The engine's prefill and decode chunk, their ahead-of-time compiled programs and
    the stop table, on the rollout mesh (data, tp)."""

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
        self._stop_sets: dict[tuple[int, ...], int] = {}
        self._stop_table: jax.Array | None = None
        self.stop_set(None)
        experts = spec.cfg.moe
        # (sparse layers, experts per token) recorded per decoded token, or None
        self.routes_shape = ((sum(experts.is_sparse(i) for i in range(m.num_layers)),
                              experts.experts_per_token)
                             if experts.num_experts and experts.replay_routing else None)
        options = sampling_compiler_options()
        self.prefill = jax.jit(self.traced(self._prefill_fn), static_argnums=(0,),
                               donate_argnums=(2, 3), compiler_options=options)
        self.chunk = jax.jit(self.traced(self._chunk_fn), static_argnums=(0,),
                             donate_argnums=(2, 3), compiler_options=options)
        self._compiled: dict[tuple, object] = {}  # ahead-of-time programs (the memory plan's)
        self.planned_calls = 0  # calls that ran an ahead-of-time program

    def num_compiles(self) -> int:
        return self.prefill._cache_size() + self.chunk._cache_size()

    def request(self, prompt: Sequence[int], seed: int, max_new_tokens: int | None = None,
                temperature: float | None = None, **images: Any) -> Request:
        """A request with the configured settings, some overridden; `images`: its
        `Request.images` and `images_key` (`gpurl.rollout.prompts.request_images`)."""
        return Request(tuple(int(t) for t in prompt), max_new_tokens or self.cfg.max_new_tokens,
                       self.cfg.temperature if temperature is None else temperature,
                       self.cfg.top_k, self.cfg.top_p, int(seed), **images)

    # ------------------------------------------------------------ ahead of time

    def compile_round(self, rows: int, width: int, group: int) -> tuple[list, float]:
        """The programs of a round of `rows` requests per process (prompts of up to
        `width` tokens, runs of `group` identical ones, rollout.max_new_tokens each) at
        their largest shapes, compiled ahead of time from abstract arrays (the round then
        dispatches them); returns (the compiled programs, the KV pool's bytes per device)."""
        out = []
        for fn, (static, *args) in self.round_programs(rows, width, group):
            compiled = fn.lower(static, *args).compile()
            self._compiled[self._key(fn, static, args)] = compiled
            out.append(compiled)
        return out, self.pool_bytes(rows, width)

    def pool_bytes(self, rows: int, width: int) -> float:
        """Bytes per device of the KV pool (keys and values) of a round of `rows` requests
        per process with prompts of up to `width` tokens."""
        pool = self.round_pool(rows, width)
        return 2.0 * math.prod(self.pool_sharding.shard_shape(pool.shape)) * pool.dtype.itemsize

    def round_pool(self, rows: int, width: int) -> jax.ShapeDtypeStruct:
        """The KV pool (keys or values) of a round of `rows` requests per process."""
        live = min(-(-rows // self.local_shards), self.cfg.slots)
        blocks = request_blocks(width + self.cfg.max_new_tokens, self.block)
        return jax.ShapeDtypeStruct(
            self.pool_shape(pool_blocks(live * blocks, self.block, self.cfg.kv_cache_tokens)),
            compute_dtype(self.spec.cfg), sharding=self.pool_sharding)

    def pool_shape(self, blocks: int) -> tuple[int, ...]:
        """The KV pool's keys (or values): shards x layers x blocks x block x heads x E."""
        layers, kv, e = self._pool_shape
        return (self.shards, layers, blocks, self.block, kv, e)

    def round_rows(self, rows: int, group: int) -> tuple[int, int, int]:
        """Rows per data shard of a round of `rows` requests per process (runs of `group`
        identical prompts) at its largest: (distinct prompts a prefill computes, rows it
        admits, rows a decode chunk steps)."""
        live = min(-(-rows // self.local_shards), self.cfg.slots)
        return bucket(-(-live // group), MIN_ROWS), bucket(live, MIN_ROWS), bucket(live)

    def round_programs(self, rows: int, width: int, group: int) -> "RoundPrograms":
        """The prefill and the decode chunk of such a round at their largest shapes
        (`compile_round` compiles them, in this order; the CUDA lowering tests lower them)."""
        blocks = request_blocks(width + self.cfg.max_new_tokens, self.block)
        pool = self.round_pool(rows, width)
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
        w = prompt_width(width)
        prefill_args = (params, pool, pool, rows_of(p, w), rows_of(p), rows_of(p), rows_of(p, 0),
                        rows_of(a, w), rows_of(a), *settings(a), stops)
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        chunk_args = (params, pool, pool, rows_of(c, bucket(blocks)), *(rows_of(c) for _ in range(3)),
                      rows_of(c, dt=jnp.bool_), *settings(c), stops, scalar, scalar)
        return RoundPrograms((self.prefill, ((sampled, truncate), *prefill_args)),
                             (self.chunk, ((sampled, truncate, self.cfg.decode_chunk), *chunk_args)))

    def _key(self, fn, static, args) -> tuple:
        shapes = tuple(tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(args[1:]))
        return fn is self.chunk, static, shapes

    def run(self, fn, static, args):
        """The ahead-of-time program for these shapes (`compile_round`), else the jitted one."""
        compiled = self._compiled.get(self._key(fn, static, args))
        self.planned_calls += compiled is not None
        return compiled(*args) if compiled is not None else fn(static, *args)

    # ------------------------------------------------------------------ stops

    def stop_set(self, r: Request | None) -> int:
        """Index of the request's stop ids in the device table (V flags per set); None:
        the engine's own (every process's table starts with them)."""
        ids = self.stop_ids if r is None or r.stop_ids is None else tuple(sorted(set(r.stop_ids)))
        if ids not in self._stop_sets:
            self._stop_sets[ids] = len(self._stop_sets)
            self._stop_table = None  # rebuilt on the next call (`stops`)
        return self._stop_sets[ids]

    def stops(self) -> jax.Array:
        """The stop sets as a device table, built when first needed (a built engine holds
        no device memory until it generates: the memory plan's check precedes it)."""
        if self._stop_table is None:
            sets = sorted(self._stop_sets, key=self._stop_sets.get)
            table = np.zeros((bucket(len(sets)), self.spec.cfg.vocab_size), bool)
            for j, s in enumerate(sets):
                table[j, list(s)] = True
            self._stop_table = jax.device_put(table, replicated(self.mesh))
        return self._stop_table

    # --------------------------------------------------------------- programs

    def _prefill_fn(self, static, params, k_pool, v_pool, tokens_BxW, starts_B, lengths_B,
                    cached_BxC, dest_BxW, src_B, seeds_B, offsets_B, temperature_B, top_k_B,
                    top_p_B, stop_set_B, stop_table, pixels=None, image_offsets_B=None):
        """Tokens `starts_B` to `lengths_B` of each distinct sequence (`tokens_BxW`, padded),
        after its `starts_B / block` cached blocks (`cached_BxC`); an admitted row's keys and
        values go to the pool slots `dest_BxW` and it samples from sequence `src_B`.
        `pixels` (B x M x 3 x H x W): a vision-language model's sequences' images, their
        image tokens before `starts_B` counted by `image_offsets_B`; such a prefill runs
        as one chunk (an image's tokens see the whole image)."""
        sampled, truncate = static
        a = self.shards
        b, w = tokens_BxW.shape
        images = dict(pixels=pixels, image_offsets=image_offsets_B)
        if w > self.cfg.prefill_chunk or cached_BxC.shape[1]:
            last_BxD, k_LxBxWxKxE, v_LxBxWxKxE = self._chunked_prompts(
                params, tokens_BxW, starts_B, lengths_B, self._cached_kv(k_pool, v_pool, cached_BxC),
                images)
        else:
            positions_BxW = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))
            segments_BxW = (positions_BxW < lengths_B[:, None]).astype(jnp.int32)
            hidden_BxWxD, kv = self.spec.prompt_kv(params, tokens_BxW, positions_BxW,
                                                   segments_BxW, 1, **images)
            last_BxD = jnp.take_along_axis(hidden_BxWxD, (lengths_B - 1)[:, None, None],
                                           axis=1)[:, 0]
            k_LxBxWxKxE, v_LxBxWxKxE = kv.k, kv.v
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
            k_pool, v_pool, _shards_second(k_LxBxWxKxE, a), _shards_second(v_LxBxWxKxE, a),
            _shards_first(logits_BxV, a), _shards_first(src_B, a), _shards_first(dest_BxW, a))
        logits_BxV = logits_BxV.reshape(-1, logits_BxV.shape[-1])
        keys_B = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.key)(seeds_B), offsets_B)
        tok_B, lp_B = sample_rows(logits_BxV, keys_B, temperature_B, top_k_B, top_p_B,
                                  sampled, truncate)
        return k_pool, v_pool, tok_B, lp_B, stop_table[stop_set_B, tok_B]


    def _cached_kv(self, k_pool: jax.Array, v_pool: jax.Array, cached_BxC: jax.Array
                   ) -> tuple[jax.Array, jax.Array] | None:
        """Every layer's keys and values in the cached blocks `cached_BxC` of each row, L x B
        x (C x block) x K x E, read from its shard's pool; None when no row has any."""
        a, c = self.shards, cached_BxC.shape[1]
        if not c:
            return None

        def read(pool_AxLxYxUxKxE):
            rows_AxLxPxCxUxKxE = jax.vmap(lambda pool, ids: pool[:, ids])(
                pool_AxLxYxUxKxE, _shards_first(cached_BxC, a))
            x = jnp.swapaxes(rows_AxLxPxCxUxKxE, 0, 1)
            return x.reshape(x.shape[0], -1, c * self.block, *x.shape[-2:])

        return read(k_pool), read(v_pool)

    def _chunked_prompts(self, params: Params, tokens_BxW: jax.Array, starts_B: jax.Array,
                         lengths_B: jax.Array, cached: tuple[jax.Array, jax.Array] | None,
                         images: dict | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(final-norm hidden state of each prompt's last token, every layer's keys and
        values of the W tokens computed, L x B x W x K x E): the tokens from `starts_B` on
        run `rollout.prefill_chunk` at a time, each chunk appended to a cache of the
        sequences' keys and values and attending to it (causal by position; sliding
        windows by position too), so no activation spans more than a chunk of a prompt;
        the keys and values span it all, as the pool they are written to does. `cached`:
        the keys and values of each sequence's tokens before `starts_B` (L x B x S x K x E,
        from the prefix cache), which the cache starts with. A chunk's queries read all
        slots, the later ones empty and masked: about twice a causal prefill's attention
        work, none of its matmuls'. With `images` (`_prefill_fn`) it is one chunk."""
        b, w = tokens_BxW.shape
        images = images or {}
        t = w if images.get("pixels") is not None else min(self.cfg.prefill_chunk, w)
        s = 0 if cached is None else cached[0].shape[2]
        cache = init_cache(self.spec.cfg, b, s + w)
        if cached is not None:
            slots_S = jnp.arange(s, dtype=jnp.int32)
            cache = cache.replace(
                k=cache.k.at[:, :, :s].set(cached[0]), v=cache.v.at[:, :, :s].set(cached[1]),
                positions=cache.positions.at[:, :s].set(slots_S),
                segments=cache.segments.at[:, :s].set(
                    (slots_S < starts_B[:, None]).astype(jnp.int32)),
                index=jnp.int32(s))
        kv_spec = P(None, "data", None, "tp", None)  # rows as the tokens, heads as the pool
        cache = cache.replace(
            k=jax.lax.with_sharding_constraint(cache.k, NamedSharding(self.mesh, kv_spec)),
            v=jax.lax.with_sharding_constraint(cache.v, NamedSharding(self.mesh, kv_spec)))
        offsets_T = jnp.arange(t, dtype=jnp.int32)

        def chunk(cache, xs):
            tokens_BxT, start = xs
            positions_BxT = starts_B[:, None] + start + offsets_T
            segments_BxT = (positions_BxT < lengths_B[:, None]).astype(jnp.int32)
            hidden_BxTxD, cache = self.spec.hidden(params, tokens_BxT, positions_BxT,
                                                   segments_BxT, cache, **images)
            at_B = jnp.clip(lengths_B - 1 - starts_B - start, 0, t - 1)  # the last token, if here
            return cache, jnp.take_along_axis(hidden_BxTxD, at_B[:, None, None], axis=1)[:, 0]

        tokens_NxBxT = jnp.swapaxes(tokens_BxW.reshape(b, w // t, t), 0, 1)
        starts_N = jnp.arange(w // t, dtype=jnp.int32) * t
        cache, here_NxBxD = jax.lax.scan(chunk, cache, (tokens_NxBxT, starts_N))
        last_BxD = here_NxBxD[(lengths_B - 1 - starts_B) // t, jnp.arange(b)]
        return last_BxD, cache.k[:, :, s:], cache.v[:, :, s:]

    def _chunk_fn(self, static, params, k_pool, v_pool, table_BxI, last_B, lengths_B,
                  left_B, active_B, seeds_B, drawn_B, temperature_B, top_k_B,
                  top_p_B, stop_set_B, stop_table, take, halve):
        sampled, truncate, steps = static
        b = last_B.shape[0]
        # the longest live row's blocks bound the attention's work; with `take` queued
        # requests (0: none) the chunk returns once that many rows finished
        longest = jnp.max(jnp.where(active_B, lengths_B, 0))
        active = jnp.sum(active_B.astype(jnp.int32))
        refill = jnp.where(take > 0, active - take, 0)
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


def _shards_first(x: jax.Array, a: int) -> jax.Array:
    return x.reshape(a, x.shape[0] // a, *x.shape[1:])


def _shards_second(x: jax.Array, a: int) -> jax.Array:
    """L x B x ... -> A x L x (B / A) x ...: a layer-stacked array's rows by shard."""
    x = x.reshape(x.shape[0], a, x.shape[1] // a, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1)


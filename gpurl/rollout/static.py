"""The static sampler, the reference the rollout engine (`engine.py`) is tested against and
the benchmarks' simplest baseline: batched generation with a KV cache, one jitted call
doing the prefill and the decode loop.

Prompts are right-padded to a length bucket and the batch to a batch bucket, so a long
run compiles a bounded number of programs. Row b's tokens keep their true positions
(RoPE, sliding windows); padded prompt slots carry segment 0 and are masked out. The
loop stops when every row has stopped (EOS or a stop id) or at `max_new_tokens`.
Rows that come in runs of identical prompts (an RL batch repeats each prompt G times) are
prefilled once per run and the KV cache is repeated: with G = 8 on the real Gemma 3 270M
(CPU) the prefill of every row was ~95% of a rollout.

Log-probabilities are those of the distribution sampled from before top-k/top-p
truncation: log_softmax(logits / temperature), or log_softmax(logits) when greedy;
`gpurl.algorithms.forward.token_logprobs` computes the same with the training forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gpurl.config import ConfigError, RolloutConfig
from gpurl.distributed import host
from gpurl.distributed.mesh import Rules, replicated
from gpurl.models.spec import ModelSpec, Params
from gpurl.models.transformer import KVCache, init_cache
from gpurl.rollout.programs import Rollout, RolloutModel
from gpurl.rollout.requests import bucket, prompt_width
from gpurl.rollout.sampling import sample

@dataclass(frozen=True)
class _Static:
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_ids: tuple[int, ...]
    pad_id: int
    group: int = 1  # rows come in runs of this many identical prompts: one prefill per run


class Prepared(tuple):
    """`StaticSampler.prepare`'s (prompt tokens B x P, prompt lengths B, seeds B), plus `group`:
    the rows come in runs of `group` identical prompts (1 = no sharing)."""

    group: int

    def __new__(cls, arrays: tuple[jax.Array, jax.Array, jax.Array], group: int) -> "Prepared":
        out = super().__new__(cls, arrays)
        out.group = group
        return out


class StaticSampler(RolloutModel):
    """Generates completions for prompts on the rollout mesh (data, tp): one static batch."""

    def __init__(self, spec: ModelSpec, cfg: RolloutConfig, mesh: Mesh, rules: Rules, *,
                 stop_ids: Sequence[int], pad_id: int):
        super().__init__(spec, cfg, mesh, rules, stop_ids=stop_ids, pad_id=pad_id)
        self._fns: dict[_Static, object] = {}
        # programs compiled ahead of time (the memory plan's), by static settings and shape
        self._compiled: dict[tuple[_Static, tuple[int, ...]], object] = {}

    def num_compiles(self) -> int:
        return sum(fn._cache_size() for fn in self._fns.values())

    def padded_rows(self, num_local: int, bucket_rows: bool = True) -> int:
        """Rows this process contributes for `num_local` prompts: the batch bucket rounded
        up to a multiple of this process's data shards (padding rows come last)."""
        data_per_process = max(self.mesh.shape["data"] // jax.process_count(), 1)
        wanted = bucket(num_local) if bucket_rows else num_local
        return math.ceil(wanted / data_per_process) * data_per_process

    def generate(self, params: Params, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                 max_new_tokens: int | None = None, temperature: float | None = None,
                 prompt_width: int | None = None, bucket_rows: bool = True) -> Rollout:
        """`prompts` and `seeds` are this process's rows; returns the global sharded rollout
        (padding rows, `padded_rows` in all, come last and should be ignored).
        `prompt_width` fixes the padded prompt length (RL: one shape for the whole run);
        `bucket_rows=False` keeps the row count (RL batches have a fixed size)."""
        batch = self.prepare(prompts, seeds, prompt_width, bucket_rows)
        return self.generate_prepared(params, batch, max_new_tokens, temperature)

    def prepare(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                prompt_width: int | None = None, bucket_rows: bool = True) -> Prepared:
        """(padded prompt tokens B x P, prompt lengths B, seeds B) as global arrays sharded
        like the rollout rows; callers that also need the prompts on device reuse them."""
        tokens, lengths, seeds_np = self._pad(prompts, seeds, prompt_width, bucket_rows)
        return Prepared(tuple(host.to_device(x, self.rows)
                              for x in (tokens, lengths, seeds_np)), self._group(tokens, lengths))

    def _group(self, tokens_BxW: np.ndarray, lengths_B: np.ndarray) -> int:
        """The longest run of identical prompts that every run of rows repeats: a divisor of
        each data shard's rows (so runs never straddle shards), agreed by all processes."""
        shard_rows = len(lengths_B) // max(self.mesh.shape["data"] // jax.process_count(), 1)
        group = 1
        for g in range(shard_rows, 1, -1):
            if shard_rows % g == 0 and _runs_of(tokens_BxW, lengths_B, g):
                group = g
                break
        if jax.process_count() > 1:  # one program shape for every process
            group = int(np.gcd.reduce(host.gather_ints(group)))
        return group

    def generate_prepared(self, params: Params, batch: tuple[jax.Array, jax.Array, jax.Array],
                          max_new_tokens: int | None = None,
                          temperature: float | None = None) -> Rollout:
        """`generate` on the arrays `prepare` returned."""
        static = self._static(max_new_tokens, temperature, getattr(batch, "group", 1))
        fn = self._compiled.get((static, batch[0].shape))
        fn = fn or self._fns.get(static) or self._fns.setdefault(static, self._compile(static))
        return fn(self.place(params), *batch)

    def _static(self, max_new_tokens: int | None, temperature: float | None, group: int) -> _Static:
        return _Static(max_new_tokens or self.cfg.max_new_tokens,
                       self.cfg.temperature if temperature is None else temperature,
                       self.cfg.top_k, self.cfg.top_p, self.stop_ids, self.pad_id, group)

    def compile(self, rows: int, width: int, group: int = 1) -> Any:
        """The program that samples `rows` global rows of prompts padded to `width` (runs of
        `group` identical prompts) at the configured settings, compiled ahead of time from
        abstract arrays; `generate` runs it for that shape."""
        static = self._static(None, None, group)
        fn = self._fns.get(static) or self._fns.setdefault(static, self._compile(static))
        params = self.abstract_params
        args = [jax.ShapeDtypeStruct(shape, dt, sharding=self.rows) for shape, dt in
                (((rows, width), jnp.int32), ((rows,), jnp.int32), ((rows,), jnp.uint32))]
        compiled = fn.lower(params, *args).compile()
        self._compiled[static, (rows, width)] = compiled
        return compiled

    def cache_layout(self, rows: int, width: int) -> tuple[KVCache, KVCache]:
        """(abstract KV cache, its shardings) of a batch of `rows` prompts padded to `width`
        at full length (prompt + rollout.max_new_tokens): what the memory plan counts."""
        cache = jax.eval_shape(lambda: init_cache(self.spec.cfg, rows,
                                                  width + self.cfg.max_new_tokens))
        return cache, _cache_shardings(cache, self.rows)

    def _pad(self, prompts, seeds, width: int | None, bucket_rows: bool
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError("a prompt is empty; every prompt needs at least one token.")
        if len(seeds) != len(prompts):
            raise ConfigError(f"{len(seeds)} seeds for {len(prompts)} prompts; give one seed per prompt.")
        longest = max(len(p) for p in prompts)
        if jax.process_count() > 1:  # every process must pick the same shapes
            longest = max(host.gather_ints(longest))
        if width is not None and longest > width:
            raise ConfigError(f"a prompt has {longest} tokens, more than the {width} allowed; "
                              f"shorten the prompt or raise data.max_len.")
        rows = self.padded_rows(len(prompts), bucket_rows)
        width = width or prompt_width(longest)
        tokens = np.full((rows, width), self.pad_id, np.int32)
        lengths = np.ones(rows, np.int32)  # padding rows: a one-token prompt
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
            lengths[i] = len(p)
        seeds_np = np.zeros(rows, np.uint32)
        seeds_np[:len(prompts)] = np.asarray(seeds, np.uint32)
        return tokens, lengths, seeds_np

    def _compile(self, static: _Static):
        return jax.jit(lambda p, t, l, s: _generate(self.spec, static, self.rows, p, t, l, s),
                       in_shardings=(self.param_shardings, self.rows, self.rows, self.rows),
                       out_shardings=Rollout(self.rows, self.rows, self.rows))


def _runs_of(tokens_BxW: np.ndarray, lengths_B: np.ndarray, g: int) -> bool:
    """Whether rows come in runs of `g` identical prompts (same tokens and length)."""
    first_PxW, first_P = tokens_BxW[::g], lengths_B[::g]
    return bool((tokens_BxW.reshape(len(first_P), g, -1) == first_PxW[:, None]).all()
                and (lengths_B.reshape(-1, g) == first_P[:, None]).all())


def _prefill(spec: ModelSpec, static: _Static, rows: NamedSharding, params: Params,
             prompt_BxW: jax.Array, prompt_len_B: jax.Array, length: int):
    """(first-token logits B x V, KV cache of B rows over `length` positions). Runs of
    `static.group` identical prompts are prefilled once and their cache rows repeated."""
    b, p = prompt_BxW.shape
    g = static.group
    positions_PxW = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b // g, p))
    segments_PxW = (positions_PxW < prompt_len_B[::g, None]).astype(jnp.int32)
    cache = init_cache(spec.cfg, b // g, length)
    if g == 1:
        cache = jax.lax.with_sharding_constraint(cache, _cache_shardings(cache, rows))
    hidden_PxWxD, cache = spec.hidden(params, prompt_BxW[::g], positions_PxW, segments_PxW, cache)
    last_PxD = jnp.take_along_axis(hidden_PxWxD, (prompt_len_B[::g] - 1)[:, None, None],
                                   axis=1)[:, 0]
    logits_PxV = spec.logits(params, last_PxD)
    if g == 1:
        return logits_PxV, cache
    cache = jax.lax.with_sharding_constraint(cache.repeat_rows(g), _cache_shardings(cache, rows))
    return jnp.repeat(logits_PxV, g, axis=0), cache


def _generate(spec: ModelSpec, static: _Static, rows: NamedSharding, params: Params,
              prompt_BxW: jax.Array, prompt_len_B: jax.Array, seeds_B: jax.Array) -> Rollout:
    b, p = prompt_BxW.shape
    n = static.max_new_tokens
    logits_BxV, cache = _prefill(spec, static, rows, params, prompt_BxW, prompt_len_B, p + n)
    keys_B = jax.vmap(jax.random.key)(seeds_B)
    stop_ids = jnp.asarray(static.stop_ids or (-1,), jnp.int32)

    def pick(logits_BxV, t):
        tok_B, lp_B = sample(logits_BxV, jax.vmap(jax.random.fold_in, (0, None))(keys_B, t),
                             static.temperature, static.top_k, static.top_p)
        return tok_B, lp_B

    tok_B, lp_B = pick(logits_BxV, 0)
    out_tokens = jnp.full((b, n), static.pad_id, jnp.int32).at[:, 0].set(tok_B)
    out_lp = jnp.zeros((b, n), jnp.float32).at[:, 0].set(lp_B)
    state = (cache, tok_B, jnp.int32(1), jnp.isin(tok_B, stop_ids), jnp.ones(b, jnp.int32),
             out_tokens, out_lp)

    def cond(state):
        _, _, t, done_B, *_ = state
        return (t < n) & ~jnp.all(done_B)

    def body(state):
        cache, prev_B, t, done_B, length_B, out_tokens, out_lp = state
        pos_Bx1 = (prompt_len_B + t - 1)[:, None]
        hidden_Bx1xD, cache = spec.hidden(params, prev_B[:, None], pos_Bx1,
                                          jnp.ones((b, 1), jnp.int32), cache)
        tok_B, lp_B = pick(spec.logits(params, hidden_Bx1xD[:, 0]), t)
        tok_B = jnp.where(done_B, static.pad_id, tok_B)
        out_tokens = jax.lax.dynamic_update_slice(out_tokens, tok_B[:, None], (0, t))
        out_lp = jax.lax.dynamic_update_slice(out_lp, jnp.where(done_B, 0.0, lp_B)[:, None], (0, t))
        length_B = length_B + (~done_B).astype(jnp.int32)
        done_B = done_B | jnp.isin(tok_B, stop_ids)
        return cache, tok_B, t + 1, done_B, length_B, out_tokens, out_lp

    _, _, _, _, length_B, out_tokens, out_lp = jax.lax.while_loop(cond, body, state)
    return Rollout(out_tokens, length_B, out_lp)


def _cache_shardings(cache: KVCache, rows: NamedSharding) -> KVCache:
    """Cache rows follow the batch; key/value heads split over tp when they divide."""
    mesh = rows.mesh
    heads = "tp" if cache.k.shape[3] % mesh.shape["tp"] == 0 else None
    kv = NamedSharding(mesh, P(None, "data", None, heads, None))  # L x B x S x K x E
    slots = NamedSharding(mesh, P("data", None))
    return KVCache(k=kv, v=kv, positions=slots, segments=slots, index=replicated(mesh))

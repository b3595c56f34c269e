"""One decoder-only transformer (Flax NNX); model families differ only by `ModelConfig`.

Every parameter carries `logical_axes` metadata ("vocab", "embed", "mlp", "heads",
"kv_heads", "head_dim", "norm", and "layers" for the stacked blocks); `gpurl.models.axes`
maps them to mesh axes. Norms are RMSNorm with a (1 + w) scale and a zero init (Gemma's
convention).

The blocks are one `Block` whose parameters have a leading `layers` axis, run by one
`lax.scan`: a step compiles one block body whatever the depth, and `model.remat` sets what
the backward pass keeps of each layer (`REMAT_POLICIES`). Stacks whose layers differ
(Gemma 2/3: sliding-window layers with their own RoPE base beside global ones) scan a
per-layer kind, and each layer's attention takes its kind's static settings by
`lax.switch`. Caches follow the layers: a sampling `KVCache` is carried through the scan
and written in place; a training forward's `PromptKV` is scanned with the layers.

Shape letter R: rotary frequencies of a head (E / 2).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gpurl.config import ModelConfig
from gpurl.kernels import platform
from gpurl.kernels.attention import Shards, attention, paged_attention, resolve
from gpurl.models import lora
from gpurl.models.layers import ACTIVATIONS, constrain_rows, context_axis, layout, param as _param
from gpurl.models import moe, vision
from gpurl.models.moe import MoE


def _on_cpu() -> bool:
    return platform.backend() == "cpu"


# Parameters every forward reads in float32 whatever the compute dtype (norm scales:
# `RMSNorm`; the MoE router: `gpurl.models.moe`), by their last key: a rollout's copy in
# the compute dtype (`ModelSpec.serving_params`) keeps them as stored.
FLOAT32_READS = ("scale", "router")


def compute_dtype(cfg: ModelConfig) -> jnp.dtype:
    """`auto`: float32 on CPU (faster there with XLA), bfloat16 on accelerators."""
    if cfg.dtype == "auto":
        return jnp.dtype(jnp.float32 if _on_cpu() else jnp.bfloat16)
    return jnp.dtype(cfg.dtype)


def _kernel_shards(num_kv_heads: int) -> Shards | None:
    """How the traced program splits attention's rows, tokens and heads (`sharded_rows`,
    `split_tokens` and its rules' `kv_heads` axes), for the Pallas kernels and the context
    axis; None when nothing is split."""
    current = layout()
    if current is None:
        return None
    mesh, spec = current.rows.mesh, current.rows.spec
    rows = spec[0] if spec else None
    axes = [a for a in (current.rules or {}).get("kv_heads", ()) if mesh.shape[a] > 1]
    split = math.prod(mesh.shape[a] for a in axes)
    heads = None if not axes or num_kv_heads % split else (axes[0] if len(axes) == 1 else tuple(axes))
    context = context_axis()
    if rows is None and heads is None and context is None:
        return None
    return Shards(mesh, rows, heads, context)


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019); Gemma scales by (1 + w) with w initialized at 0."""

    def __init__(self, dim: int, eps: float, plus_one: bool, param_dtype: Any):
        init = jnp.zeros if plus_one else jnp.ones
        self.scale = nnx.Param(init((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (y * (1.0 + scale if self.plus_one else scale)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig, is_global: bool) -> np.ndarray:
    """Inverse frequencies theta^(-2i/d) of one layer, with the layer's base and scaling
    (computed in float64 on the host, then rounded once to float32)."""
    theta = cfg.rope_theta if is_global or cfg.rope_local_theta is None else cfg.rope_local_theta
    inv_freq_R = 1.0 / theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
    if is_global and cfg.rope_scaling == "linear":  # position interpolation (Chen et al. 2023, eq. 4)
        inv_freq_R = inv_freq_R / cfg.rope_scaling_factor
    elif is_global and cfg.rope_scaling == "llama3":
        inv_freq_R = _llama3_scaling(inv_freq_R, cfg)
    return inv_freq_R.astype(np.float32)


def _llama3_scaling(inv_freq_R: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Llama 3.1 RoPE scaling (Meta's reference code for Llama 3.1): long wavelengths are
    divided by `factor`, short ones kept, the band between interpolated smoothly."""
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen_R = 2 * math.pi / inv_freq_R
    low_wavelen, high_wavelen = cfg.rope_original_max_len / low, cfg.rope_original_max_len / high
    smooth_R = (cfg.rope_original_max_len / wavelen_R - low) / (high - low)
    smoothed_R = (1 - smooth_R) * inv_freq_R / factor + smooth_R * inv_freq_R
    out_R = np.where(wavelen_R > low_wavelen, inv_freq_R / factor, inv_freq_R)
    medium_R = (wavelen_R >= high_wavelen) & (wavelen_R <= low_wavelen)
    return np.where(medium_R, smoothed_R, out_R)


def rope(x: jax.Array, positions_BxT: jax.Array, inv_freq_R: jax.Array) -> jax.Array:
    """Rotary embedding (Su et al. 2021, RoFormer, eq. 34), half-split layout as in HF, of
    queries or keys `x` (B x T x heads x E)."""
    angles_BxTxR = positions_BxT[..., None].astype(jnp.float32) * inv_freq_R
    sin, cos = jnp.sin(angles_BxTxR)[:, :, None, :], jnp.cos(angles_BxTxR)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# What the backward pass keeps of a layer's forward (`model.remat`); the rest is recomputed.
REMAT_POLICIES = {
    "none": None,  # keep everything (no rematerialization)
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only the layer's input
    # the outputs of matmuls without batch dimensions: the projections and the MLP
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # the query, key and value projections (`checkpoint_name` in `Attention._project`)
    "qkv": jax.checkpoint_policies.save_only_these_names("q_proj", "k_proj", "v_proj"),
}


def remat_policy(cfg: ModelConfig) -> str:
    """`auto`: full on accelerators (activations bound memory there), none on CPU."""
    if cfg.remat == "auto":
        return "none" if _on_cpu() else "full"
    return cfg.remat


def unrolled_sampling(cfg: ModelConfig) -> bool:
    """`model.sampling_layers`; auto: unrolled on accelerators (XLA's GPU compiler copies
    a scanned layer's weights out of the stack before each matmul, which in a decode step,
    bound by reading the weights, triples their traffic), a scan on CPU (faster compiles)."""
    if cfg.sampling_layers == "auto":
        return not _on_cpu()
    return cfg.sampling_layers == "unrolled"


def layer_kinds(cfg: ModelConfig) -> tuple[tuple[bool, ...], tuple[int, ...]]:
    """(is_global of each kind, kind of each layer): the distinct attention settings of the
    stack, global (whole context, global RoPE) before sliding-window ones."""
    flags = [cfg.is_global(i) for i in range(cfg.num_layers)]
    kinds = tuple(sorted(set(flags), reverse=True))
    return kinds, tuple(kinds.index(f) for f in flags)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, k, hd, pd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.param_dtype
        self.q = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), cfg.init_std, pd)
        self.k = _param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std, pd)
        self.v = _param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std, pd)
        self.o = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), cfg.init_std, pd)
        if cfg.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, hd), pd), logical_axes=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((k, hd), pd), logical_axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((k, hd), pd), logical_axes=("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_plus_one, pd)
            self.k_norm = RMSNorm(hd, cfg.norm_eps, cfg.norm_plus_one, pd)
        # static per kind: (sliding window or None, RoPE key); frequencies are constants under jit
        self.kinds = tuple((None if is_global else cfg.sliding_window, (cfg, is_global))
                           for is_global in layer_kinds(cfg)[0])
        self.scale = (cfg.query_pre_attn_scalar or hd) ** -0.5
        self.softcap = cfg.attn_softcap
        self.has_bias, self.has_qk_norm = cfg.qkv_bias, cfg.qk_norm
        self.implementation = resolve(cfg.attention)

    def _project(self, x_BxTxD: jax.Array, name: str, layer: jax.Array) -> jax.Array:
        dt = x_BxTxD.dtype
        out = jnp.einsum("btd,dne->btne", x_BxTxD, getattr(self, name)[...].astype(dt))
        out = lora.adapted(self, name, x_BxTxD, out, layer)
        if self.has_bias:
            out = out + getattr(self, f"{name}_bias")[...].astype(dt)
        if self.has_qk_norm and name in ("q", "k"):
            out = getattr(self, f"{name}_norm")(out)
        return checkpoint_name(constrain_rows(out), f"{name}_proj")

    def __call__(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, segments_BxT: jax.Array,
                 kind: jax.Array, layer: jax.Array, cache: KVCache | PromptKV | None = None,
                 sees_BxT: jax.Array | None = None
                 ) -> tuple[jax.Array, KVCache | PromptKV | None, tuple[jax.Array, jax.Array]]:
        """(output B x T x D, the cache, this layer's keys and values of the T tokens after
        RoPE: what `Transformer.prompt_kv` keeps). `sees_BxT`: the last position each
        token sees when image tokens see their whole image (`vision.image_sees`)."""
        q_BxTxHxE = self._project(x_BxTxD, "q", layer)
        k_BxTxKxE = self._project(x_BxTxD, "k", layer)
        v_BxTxKxE = self._project(x_BxTxD, "v", layer)

        def attend(window: int | None, rope_key: tuple, q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, cache):
            inv_freq_R = jnp.asarray(rope_frequencies(*rope_key))
            q_BxTxHxE = rope(q_BxTxHxE, positions_BxT, inv_freq_R)
            k_BxTxKxE = rope(k_BxTxKxE, positions_BxT, inv_freq_R)
            shards = _kernel_shards(k_BxTxKxE.shape[2])
            if isinstance(cache, PagedKV):  # one decode step over a paged pool
                out, cache = cache.attend(layer, q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, scale=self.scale,
                                          softcap=self.softcap, window=window,
                                          implementation=self.implementation, shards=shards)
                return out, cache, (k_BxTxKxE, v_BxTxKxE)
            own = cache is None or isinstance(cache, SharedPrefix)  # self-attention
            if own:
                keys, values, kv_pos, kv_seg = k_BxTxKxE, v_BxTxKxE, positions_BxT, segments_BxT
            else:
                keys, values, kv_pos, kv_seg, cache = cache.extend(
                    layer, k_BxTxKxE, v_BxTxKxE, positions_BxT, segments_BxT)
            out = attention(q_BxTxHxE, keys, values, positions_BxT, segments_BxT, kv_pos,
                            kv_seg, scale=self.scale, softcap=self.softcap, window=window,
                            contiguous=own, shared_prefix=cache is not None and own,
                            implementation=self.implementation, shards=shards,
                            q_sees_BxT=sees_BxT)
            return out, cache, (k_BxTxKxE, v_BxTxKxE)

        branches = [functools.partial(attend, *k) for k in self.kinds]
        args = (q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, cache)
        out_BxTxHxE, cache, kv = (branches[0](*args) if len(branches) == 1
                                  else jax.lax.switch(kind, branches, *args))
        o_BxTxD = jnp.einsum("bthe,hed->btd", out_BxTxHxE, self.o[...].astype(x_BxTxD.dtype))
        return lora.adapted(self, "o", out_BxTxHxE, o_BxTxD, layer), cache, kv


class MLP(nnx.Module):
    """Gated MLP: GeGLU (Shazeer 2020) for Gemma, SwiGLU for Llama/Qwen."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.mlp_dim, cfg.param_dtype
        self.gate = _param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, pd)
        self.up = _param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, pd)
        self.down = _param(rngs, (f, d), ("mlp", "embed"), cfg.init_std, pd)
        self.act = ACTIVATIONS[cfg.activation]

    def __call__(self, x_BxTxD: jax.Array, layer: jax.Array) -> jax.Array:
        dt = x_BxTxD.dtype
        gate_BxTxF = lora.adapted(self, "gate", x_BxTxD, x_BxTxD @ self.gate[...].astype(dt), layer)
        up_BxTxF = lora.adapted(self, "up", x_BxTxD, x_BxTxD @ self.up[...].astype(dt), layer)
        h_BxTxF = constrain_rows(self.act(constrain_rows(gate_BxTxF)) * constrain_rows(up_BxTxF))
        return lora.adapted(self, "down", h_BxTxF, h_BxTxF @ self.down[...].astype(dt), layer)


class Block(nnx.Module):
    """Pre-norm block; Gemma 2/3 add a norm after attention and after the MLP. A sparse
    block's MLP is a mixture of experts (`moe`). One Block holds all layers of a stack:
    each parameter has a leading `layers` axis (`stack_layers`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sparse: bool = False):
        def norm() -> RMSNorm:
            return RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_plus_one, cfg.param_dtype)

        self.attn_norm = norm()
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = norm()
        if sparse:
            self.moe = MoE(cfg, rngs)
        else:
            self.mlp = MLP(cfg, rngs)
        if cfg.post_norms:
            self.post_attn_norm = norm()
            self.post_mlp_norm = norm()
        self.post_norms, self.sparse = cfg.post_norms, sparse

    def __call__(self, x_BxTxD, positions_BxT, segments_BxT, kind, layer, cache=None, routes=None,
                 sees_BxT=None):
        """(output, cache, this layer's keys and values, router stats and chosen experts
        of a sparse block, else None)."""
        h_BxTxD, cache, kv = self.attn(self.attn_norm(x_BxTxD), positions_BxT, segments_BxT,
                                       kind, layer, cache, sees_BxT)
        x_BxTxD = x_BxTxD + (self.post_attn_norm(h_BxTxD) if self.post_norms else h_BxTxD)
        routing = None
        if self.sparse:
            h_BxTxD, stats, experts = self.moe(self.mlp_norm(x_BxTxD), segments_BxT > 0, routes)
            routing = (stats, experts)
        else:
            h_BxTxD = self.mlp(self.mlp_norm(x_BxTxD), layer)
        x_BxTxD = x_BxTxD + (self.post_mlp_norm(h_BxTxD) if self.post_norms else h_BxTxD)
        return x_BxTxD, cache, kv, routing


STACKS = ("blocks", "dense_blocks")  # the modules holding layers stacked (`layer_stacks`)


def layer_stacks(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """(stack, index in the stack) of each layer. One stack, `blocks`, unless a
    mixture-of-experts model has dense layers too: those are `dense_blocks` (their MLP has
    other parameters, so they cannot share a stack with the sparse ones)."""
    sparse = [cfg.moe.is_sparse(i) for i in range(cfg.num_layers)]
    mixed = any(sparse) and not all(sparse)
    names = ["dense_blocks" if mixed and not is_sparse else "blocks" for is_sparse in sparse]
    return tuple((n, names[:i].count(n)) for i, n in enumerate(names))


def layer_runs(cfg: ModelConfig) -> list[tuple[str, int, int, int]]:
    """Consecutive layers of one stack, in order: (stack, first index in it, count, first layer)."""
    runs: list[tuple[str, int, int, int]] = []
    for layer, (name, index) in enumerate(layer_stacks(cfg)):
        if runs and runs[-1][0] == name:
            runs[-1] = runs[-1][:2] + (runs[-1][2] + 1, runs[-1][3])
        else:
            runs.append((name, index, 1, layer))
    return runs


def stack_layers(blocks: list[Block]) -> Block:
    """One Block whose parameters are the given blocks' stacked on a leading `layers` axis
    (the blocks are built one by one first, so they draw the same random init as an
    unrolled stack)."""
    graphdef, first = nnx.split(blocks[0])
    states = [first] + [nnx.split(b)[1] for b in blocks[1:]]
    stacked = nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
    for _, var in nnx.iter_graph(stacked):
        if isinstance(var, nnx.Param):
            var.set_metadata("logical_axes", ("layers",) + tuple(var.get_metadata()["logical_axes"]))
    return stacked


# A stack's parameters layer by layer: stack name -> one parameter tree per layer.
Layers = dict[str, list[Any]]


def _unrolled(layer: Callable, carry: Any, xs: tuple, states: list[Any]) -> tuple[Any, Any]:
    """`jax.lax.scan(layer, carry, xs)` unrolled, each layer's parameters its own arrays
    (`states`) instead of a slice of the stack in `xs[0]`: XLA's GPU compiler copies a
    slice of a stacked weight out before a matmul reads it, which in a decode step,
    bound by reading the weights, doubles their traffic."""
    outs = []
    for j, state in enumerate(states):
        carry, out = layer(carry, (state,) + jax.tree.map(lambda x, j=j: x[j], xs[1:]))
        outs.append(out)
    return carry, jax.tree.map(lambda *ys: jnp.stack(ys), *outs)


class Transformer(nnx.Module):
    """tokens, positions, segment ids (0 = padding) -> next-token logits B x T x V."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = compute_dtype(cfg)
        # Embedding std 1/sqrt(D) so that the sqrt(D) scaling gives unit-scale inputs.
        emb_std = 1.0 / math.sqrt(cfg.d_model) if cfg.scale_embeddings else cfg.init_std
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), emb_std,
                            cfg.param_dtype)
        blocks = [Block(cfg, rngs, cfg.moe.is_sparse(i)) for i in range(cfg.num_layers)]
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_plus_one, cfg.param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                  cfg.init_std, cfg.param_dtype)
        if cfg.lora.rank:
            lora.attach(blocks, cfg, rngs)
        stacks = [name for name, _ in layer_stacks(cfg)]
        self.blocks = stack_layers([b for b, n in zip(blocks, stacks) if n == "blocks"])
        if "dense_blocks" in stacks:
            self.dense_blocks = stack_layers([b for b, n in zip(blocks, stacks) if n == "dense_blocks"])
        self.layer_kinds = layer_kinds(cfg)[1]
        self.remat = remat_policy(cfg)

    def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
                 segments_BxT: jax.Array, images_BxJxD: jax.Array | None = None) -> jax.Array:
        hidden_BxTxD, _ = self.hidden(tokens_BxT, positions_BxT, segments_BxT,
                                      images_BxJxD=images_BxJxD)
        return self.logits(hidden_BxTxD)

    def hidden(self, tokens_BxT: jax.Array, positions_BxT: jax.Array, segments_BxT: jax.Array,
               cache: KVCache | PromptKV | SharedPrefix | None = None,
               routes: jax.Array | None = None, layers: Layers | None = None,
               images_BxJxD: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """Final-norm hidden states of the T tokens. With a `KVCache` (sampling) they are
        appended to it; with a `PromptKV` (a training forward) they attend to its prompts;
        with `SHARED_PREFIX` they are packed rows whose segments have shared prefixes
        (`gpurl.kernels.segments`).
        `routes`: experts the sampler chose for these tokens (routing replay;
        -1 routes a token afresh). `layers`: each stack's parameters layer by layer (a
        rollout's copy, `gpurl.models.spec.ModelSpec.serving_params`), run unrolled in
        place of the module's stacks. `images_BxJxD`: a vision-language model's image
        tokens' embeddings, each row's in the order its image tokens come (`vision.
        place_images`); its image tokens then see their whole image."""
        x_BxTxD, cache, _ = self._layers(tokens_BxT, positions_BxT, segments_BxT, cache, False,
                                         routes, layers, images_BxJxD)
        return x_BxTxD, cache

    def prompt_kv(self, tokens_PxW: jax.Array, positions_PxW: jax.Array,
                  segments_PxW: jax.Array, group: int, layers: Layers | None = None,
                  images_PxJxD: jax.Array | None = None) -> tuple[jax.Array, PromptKV]:
        """(final-norm hidden states of P prompts, every layer's keys and values of them)
        for `group` completions per prompt to attend to (`hidden` with the PromptKV)."""
        x_PxWxD, _, (k, v) = self._layers(tokens_PxW, positions_PxW, segments_PxW, None, True,
                                          None, layers, images_PxJxD)
        return x_PxWxD, PromptKV(k, v, positions_PxW, segments_PxW, group)

    def _layers(self, tokens_BxT: jax.Array, positions_BxT: jax.Array, segments_BxT: jax.Array,
                cache: KVCache | PromptKV | None, keep_kv: bool,
                routes: jax.Array | None = None, layers: Layers | None = None,
                images_BxJxD: jax.Array | None = None) -> tuple[jax.Array, Any, Any]:
        """The embedding and one `lax.scan` per run of layers of one stack (`layer_runs`;
        one scan unless a mixture-of-experts model mixes dense layers in): (final-norm
        hidden states, the carried KVCache, with `keep_kv` every layer's keys and values).
        A sparse layer's router stats go to `moe.record`; `routes` (L sparse layers x B x
        T x k) replays recorded expert choices."""
        x_BxTxD = jnp.take(self.embed[...].astype(self.dtype), tokens_BxT, axis=0)
        if self.cfg.scale_embeddings:
            # Gemma rounds the normalizer to the compute dtype before multiplying.
            x_BxTxD = x_BxTxD * jnp.asarray(math.sqrt(self.cfg.d_model), self.dtype)
        sees_BxT = None
        if images_BxJxD is not None:  # after the scaling: image features are not scaled
            is_image_BxT = vision.image_tokens(tokens_BxT, self.cfg)
            x_BxTxD = vision.place_images(x_BxTxD, is_image_BxT, images_BxJxD)
            sees_BxT = vision.image_sees(is_image_BxT, positions_BxT)
        # sampling: written in place, layer by layer
        carried = isinstance(cache, (KVCache, PagedKV))
        if isinstance(cache, KVCache):
            start = (0, cache.index)
            cache = cache.replace(
                positions=jax.lax.dynamic_update_slice(cache.positions, positions_BxT, start),
                segments=jax.lax.dynamic_update_slice(cache.segments, segments_BxT, start))
        prompt = cache if isinstance(cache, PromptKV) else None
        shared = cache if isinstance(cache, SharedPrefix) else None
        kinds = jnp.asarray(self.layer_kinds, jnp.int32)
        kv_parts, stats_parts = [], []
        for name, first, count, layer0 in layer_runs(self.cfg):
            graphdef, stacked = nnx.split(getattr(self, name))
            if count != jax.tree.leaves(stacked)[0].shape[0]:
                stacked = jax.tree.map(lambda v, a=first, n=count: v[a:a + n], stacked)
            run = slice(layer0, layer0 + count)
            replayed = None  # this run's sparse layers' slice (sparse layers are `blocks`)
            if routes is not None and name == "blocks":
                replayed = routes[first:first + count]
            xs = (stacked, kinds[run], jnp.arange(layer0, layer0 + count, dtype=jnp.int32),
                  None if prompt is None else (prompt.k[run], prompt.v[run]), replayed)
            fn = self._layer_fn(graphdef, positions_BxT, segments_BxT, prompt, carried, keep_kv,
                                shared, sees_BxT)
            carry = (x_BxTxD, cache if carried else None)
            if layers is None:
                carry, (kv, routing) = jax.lax.scan(fn, carry, xs)
            else:  # unrolled over separate arrays: each matmul reads its weights in place
                carry, (kv, routing) = _unrolled(fn, carry, xs, layers[name][first:first + count])
            x_BxTxD, cache = carry
            kv_parts.append(kv)
            if routing is not None:
                stats_parts.append(routing)
        if stats_parts:
            moe.record(jax.tree.map(lambda *xs: jnp.concatenate(xs), *(s for s, _ in stats_parts)))
            if moe.recording_experts():
                moe.record_experts(jnp.concatenate([e for _, e in stats_parts]))
        kv = (kv_parts[0] if len(kv_parts) == 1 or not keep_kv else
              jax.tree.map(lambda *xs: jnp.concatenate(xs), *kv_parts))
        if isinstance(cache, KVCache):
            cache = cache.replace(index=cache.index + tokens_BxT.shape[1])
        return self.final_norm(x_BxTxD), cache, kv

    def _layer_fn(self, graphdef: Any, positions_BxT: jax.Array, segments_BxT: jax.Array,
                  prompt: PromptKV | None, carried: bool, keep_kv: bool,
                  shared: SharedPrefix | None = None, sees_BxT: jax.Array | None = None):
        """The scan body over one run of stacked layers."""
        keep_experts = moe.recording_experts()

        def layer(carry, xs):
            x_BxTxD, kv_cache = carry
            state, kind, index, prompt_kv, routes = xs
            if prompt is not None:  # this layer's slice of the prompts' keys and values
                kv_cache = prompt.replace(k=prompt_kv[0], v=prompt_kv[1])
            elif shared is not None:
                kv_cache = shared
            x_BxTxD, kv_cache, kv, routing = nnx.merge(graphdef, state)(
                constrain_rows(x_BxTxD), positions_BxT, segments_BxT, kind, index, kv_cache, routes,
                sees_BxT)
            x_BxTxD = constrain_rows(x_BxTxD)
            if routing is not None and not keep_experts:
                routing = (routing[0], None)
            return (x_BxTxD, kv_cache if carried else None), (kv if keep_kv else None, routing)

        # The backward pass keeps what the policy saves of each layer and recomputes the
        # rest. A carried cache belongs to sampling, which has no backward pass; a PromptKV
        # is scanned (not carried), so no copy of it is saved per layer.
        if not carried and self.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
        return layer

    def logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
        """Output logits of final-norm hidden states (any leading shape), float32 in every
        compute dtype: the matmul reads its operands in the compute dtype and accumulates
        and writes float32 (`preferred_element_type`), so a bfloat16 run's logits carry no
        bfloat16 rounding (0.06-0.125 at magnitudes 10-30, which the log-probs, the
        ratios and the importance weights of RL would read as a policy change; MiniMax-M1,
        2025, traced most of its sampler/trainer mismatch to such a head). Every head
        runs through here: the trainer's chunks, the sampler, a teacher."""
        hidden = hidden_BxTxD.astype(self.dtype)
        if self.cfg.tie_embeddings:
            logits = jnp.einsum("...d,vd->...v", hidden, self.embed[...].astype(self.dtype),
                                preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("...d,dv->...v", hidden, self.lm_head[...].astype(self.dtype),
                                preferred_element_type=jnp.float32)
        if self.cfg.final_softcap is not None:
            cap = self.cfg.final_softcap
            logits = cap * jnp.tanh(logits / cap)
        return logits


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for S slots per row, stacked like the layers
    (sliding-window layers keep all slots too; the attention mask restricts them to their
    window). Slots [index, index + T) take the next T tokens."""

    k: jax.Array  # L x B x S x K x E
    v: jax.Array  # L x B x S x K x E
    positions: jax.Array  # B x S: position of the token in each slot
    segments: jax.Array  # B x S: 0 = empty slot (masked out)
    index: jax.Array  # int32 scalar

    def extend(self, layer: jax.Array, k_BxTxKxE: jax.Array, v_BxTxKxE: jax.Array,
               positions_BxT: jax.Array, segments_BxT: jax.Array) -> tuple:
        """(this layer's keys B x S x K x E and values with the T new tokens, their positions
        and segments B x S, the cache): only the T new slots are written (in place in the
        scan's carry; `Transformer.hidden` has written their positions)."""
        start = (layer, 0, self.index, 0, 0)
        k = jax.lax.dynamic_update_slice(self.k, k_BxTxKxE[None].astype(self.k.dtype), start)
        v = jax.lax.dynamic_update_slice(self.v, v_BxTxKxE[None].astype(self.v.dtype), start)
        return k[layer], v[layer], self.positions, self.segments, self.replace(k=k, v=v)

    def repeat_rows(self, g: int) -> KVCache:
        """Every row repeated `g` times (a prompt's cache shared by its G completions)."""
        return self.replace(k=jnp.repeat(self.k, g, axis=1), v=jnp.repeat(self.v, g, axis=1),
                            positions=jnp.repeat(self.positions, g, axis=0),
                            segments=jnp.repeat(self.segments, g, axis=0))


@flax.struct.dataclass
class PagedKV:
    """A paged KV pool for one decode step of B rows (`gpurl.kernels.paged_attention`):
    each row's new token is written at position `lengths[b]` of its blocks and attends to
    the row's tokens up to it. Carried through the layer scan like `KVCache`."""

    k: jax.Array  # A x L x Y x U x K x E: per data shard, layers, blocks of U slots
    v: jax.Array  # A x L x Y x U x K x E
    table: jax.Array  # B x I: the blocks of each row, in order
    lengths: jax.Array  # B: tokens of each row already in the pool (the new token's position)
    live: jax.Array  # int32 scalar: blocks to visit, at least the longest row's

    def attend(self, layer: jax.Array, q_Bx1xHxE: jax.Array, k_Bx1xKxE: jax.Array,
               v_Bx1xKxE: jax.Array, **kwargs: Any) -> tuple[jax.Array, PagedKV]:
        """(attention output B x 1 x H x E, the pool with the new keys and values)."""
        out_BxHxE, k, v = paged_attention(
            q_Bx1xHxE[:, 0], k_Bx1xKxE[:, 0], v_Bx1xKxE[:, 0], self.k, self.v, layer,
            self.table, self.lengths, self.live, **kwargs)
        return out_BxHxE[:, None], self.replace(k=k, v=v)


@flax.struct.dataclass
class SharedPrefix:
    """The cache argument of a training forward over packed rows whose segments have
    shared prefixes (`gpurl.kernels.segments`): no arrays, only the attention mode."""


SHARED_PREFIX = SharedPrefix()


@flax.struct.dataclass
class PromptKV:
    """Every layer's keys and values of P prompts (`Transformer.prompt_kv`) that the G
    completions of each prompt attend to: a training forward's cache. It is scanned with
    the layers, one layer's slice at a time, never carried, so a backward pass does not
    save a copy of it per layer."""

    k: jax.Array  # L x P x W x K x E (inside the scan: one layer's P x W x K x E)
    v: jax.Array  # L x P x W x K x E
    positions: jax.Array  # P x W
    segments: jax.Array  # P x W: 0 = padding
    group: int = flax.struct.field(pytree_node=False, default=1)  # completions per prompt

    def extend(self, layer: jax.Array, k_BxTxKxE: jax.Array, v_BxTxKxE: jax.Array,
               positions_BxT: jax.Array, segments_BxT: jax.Array) -> tuple:
        """(the prompt's keys then the T new ones, B x (W+T) x K x E, values, positions,
        segments, itself) for B = P x G rows."""
        def rows(prompt, new):
            return jnp.concatenate([jnp.repeat(prompt, self.group, axis=0).astype(new.dtype),
                                    new], axis=1)
        return (rows(self.k, k_BxTxKxE), rows(self.v, v_BxTxKxE),
                rows(self.positions, positions_BxT), rows(self.segments, segments_BxT), self)


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    dt = compute_dtype(cfg)
    return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
                   positions=jnp.zeros((batch, length), jnp.int32),
                   segments=jnp.zeros((batch, length), jnp.int32),
                   index=jnp.zeros((), jnp.int32))

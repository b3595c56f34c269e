"""One decoder-only transformer (Flax NNX); model families differ only by `ModelConfig`.

Every parameter carries `logical_axes` metadata ("vocab", "embed", "mlp", "heads",
"kv_heads", "head_dim", "norm"); `gpurl.distributed.mesh` maps them to mesh axes.
Norms are RMSNorm with a (1 + w) scale and a zero init (Gemma's convention).
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gpurl.config import ModelConfig
from gpurl.kernels.attention import attention, resolve
from gpurl.models import lora

_ACTIVATIONS = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


def compute_dtype(cfg: ModelConfig) -> jnp.dtype:
    """`auto`: float32 on CPU (faster there with XLA), bfloat16 on accelerators."""
    if cfg.dtype == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    return jnp.dtype(cfg.dtype)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float,
           dtype: Any) -> nnx.Param:
    value = std * jax.random.normal(rngs.params(), shape, dtype=jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


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


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
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
        is_global = cfg.is_global(layer)
        self.window = None if is_global else cfg.sliding_window
        self.rope_key = (cfg, is_global)  # static: frequencies are constants under jit
        self.scale = (cfg.query_pre_attn_scalar or hd) ** -0.5
        self.softcap = cfg.attn_softcap
        self.has_bias, self.has_qk_norm = cfg.qkv_bias, cfg.qk_norm
        self.implementation = resolve(cfg.attention)

    def _project(self, x_BxTxD: jax.Array, name: str) -> jax.Array:
        dt = x_BxTxD.dtype
        out = jnp.einsum("btd,dne->btne", x_BxTxD, getattr(self, name)[...].astype(dt))
        out = lora.adapted(self, name, x_BxTxD, out)
        if self.has_bias:
            out = out + getattr(self, f"{name}_bias")[...].astype(dt)
        if self.has_qk_norm and name in ("q", "k"):
            out = getattr(self, f"{name}_norm")(out)
        return out

    def __call__(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, segments_BxT: jax.Array,
                 cache: LayerCache | None = None) -> tuple[jax.Array, LayerCache | None]:
        inv_freq_R = jnp.asarray(rope_frequencies(*self.rope_key))
        q_BxTxHxE = rope(self._project(x_BxTxD, "q"), positions_BxT, inv_freq_R)
        k_BxTxKxE = rope(self._project(x_BxTxD, "k"), positions_BxT, inv_freq_R)
        v_BxTxKxE = self._project(x_BxTxD, "v")
        if cache is None:
            keys, values, kv_pos, kv_seg = k_BxTxKxE, v_BxTxKxE, positions_BxT, segments_BxT
        else:
            # New keys/values go into slots [index, index + T) of the cache; the caller has
            # already written those slots' positions and segment ids.
            start = (0, cache.index, 0, 0)
            keys = jax.lax.dynamic_update_slice(cache.k, k_BxTxKxE.astype(cache.k.dtype), start)
            values = jax.lax.dynamic_update_slice(cache.v, v_BxTxKxE.astype(cache.v.dtype), start)
            kv_pos, kv_seg = cache.positions, cache.segments
            cache = cache.replace(k=keys, v=values)
        out_BxTxHxE = attention(q_BxTxHxE, keys, values, positions_BxT, segments_BxT, kv_pos,
                                kv_seg, scale=self.scale, softcap=self.softcap,
                                window=self.window, contiguous=cache is None,
                                implementation=self.implementation)
        o_BxTxD = jnp.einsum("bthe,hed->btd", out_BxTxHxE, self.o[...].astype(x_BxTxD.dtype))
        return lora.adapted(self, "o", out_BxTxHxE, o_BxTxD), cache


class MLP(nnx.Module):
    """Gated MLP: GeGLU (Shazeer 2020) for Gemma, SwiGLU for Llama/Qwen."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.mlp_dim, cfg.param_dtype
        self.gate = _param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, pd)
        self.up = _param(rngs, (d, f), ("embed", "mlp"), cfg.init_std, pd)
        self.down = _param(rngs, (f, d), ("mlp", "embed"), cfg.init_std, pd)
        self.act = _ACTIVATIONS[cfg.activation]

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        dt = x_BxTxD.dtype
        gate_BxTxF = lora.adapted(self, "gate", x_BxTxD, x_BxTxD @ self.gate[...].astype(dt))
        up_BxTxF = lora.adapted(self, "up", x_BxTxD, x_BxTxD @ self.up[...].astype(dt))
        h_BxTxF = self.act(gate_BxTxF) * up_BxTxF
        return lora.adapted(self, "down", h_BxTxF, h_BxTxF @ self.down[...].astype(dt))


class Block(nnx.Module):
    """Pre-norm block; Gemma 2/3 add a norm after attention and after the MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        def norm() -> RMSNorm:
            return RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_plus_one, cfg.param_dtype)

        self.attn_norm = norm()
        self.attn = Attention(cfg, layer, rngs)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, rngs)
        if cfg.post_norms:
            self.post_attn_norm = norm()
            self.post_mlp_norm = norm()
        self.post_norms = cfg.post_norms

    def __call__(self, x_BxTxD, positions_BxT, segments_BxT, cache=None):
        h_BxTxD, cache = self.attn(self.attn_norm(x_BxTxD), positions_BxT, segments_BxT, cache)
        x_BxTxD = x_BxTxD + (self.post_attn_norm(h_BxTxD) if self.post_norms else h_BxTxD)
        h_BxTxD = self.mlp(self.mlp_norm(x_BxTxD))
        return x_BxTxD + (self.post_mlp_norm(h_BxTxD) if self.post_norms else h_BxTxD), cache


class Transformer(nnx.Module):
    """tokens, positions, segment ids (0 = padding) -> next-token logits B x T x V."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = compute_dtype(cfg)
        # Embedding std 1/sqrt(D) so that the sqrt(D) scaling gives unit-scale inputs.
        emb_std = 1.0 / math.sqrt(cfg.d_model) if cfg.scale_embeddings else cfg.init_std
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), emb_std,
                            cfg.param_dtype)
        self.blocks = nnx.List([Block(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_plus_one, cfg.param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                  cfg.init_std, cfg.param_dtype)
        if cfg.lora.rank:
            lora.attach(self, cfg, rngs)

    def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
                 segments_BxT: jax.Array) -> jax.Array:
        hidden_BxTxD, _ = self.hidden(tokens_BxT, positions_BxT, segments_BxT)
        return self.logits(hidden_BxTxD)

    def hidden(self, tokens_BxT: jax.Array, positions_BxT: jax.Array, segments_BxT: jax.Array,
               cache: KVCache | None = None) -> tuple[jax.Array, KVCache | None]:
        """Final-norm hidden states; with a cache, the T new tokens are appended to it."""
        x_BxTxD = jnp.take(self.embed[...].astype(self.dtype), tokens_BxT, axis=0)
        if self.cfg.scale_embeddings:
            # Gemma rounds the normalizer to the compute dtype before multiplying.
            x_BxTxD = x_BxTxD * jnp.asarray(math.sqrt(self.cfg.d_model), self.dtype)
        if cache is not None:
            start = (0, cache.index)
            cache = cache.replace(
                positions=jax.lax.dynamic_update_slice(cache.positions, positions_BxT, start),
                segments=jax.lax.dynamic_update_slice(cache.segments, segments_BxT, start))
        new_k, new_v = [], []
        for i, block in enumerate(self.blocks):
            layer = None if cache is None else LayerCache(
                cache.k[i], cache.v[i], cache.positions, cache.segments, cache.index)
            x_BxTxD, layer = block(x_BxTxD, positions_BxT, segments_BxT, layer)
            if layer is not None:
                new_k.append(layer.k)
                new_v.append(layer.v)
        if cache is not None:
            cache = cache.replace(k=tuple(new_k), v=tuple(new_v),
                                  index=cache.index + tokens_BxT.shape[1])
        return self.final_norm(x_BxTxD), cache

    def logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
        """Output logits of final-norm hidden states (any leading shape)."""
        if self.cfg.tie_embeddings:
            logits = jnp.einsum("...d,vd->...v", hidden_BxTxD, self.embed[...].astype(self.dtype))
        else:
            logits = hidden_BxTxD @ self.lm_head[...].astype(self.dtype)
        if self.cfg.final_softcap is not None:
            cap = self.cfg.final_softcap
            logits = cap * jnp.tanh(logits.astype(jnp.float32) / cap)
        return logits


@flax.struct.dataclass
class LayerCache:
    k: jax.Array  # B x S x K x E
    v: jax.Array  # B x S x K x E
    positions: jax.Array  # B x S: position of the token in each slot
    segments: jax.Array  # B x S: 0 = empty slot (masked out)
    index: jax.Array  # int32: first slot the next tokens are written to


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for S slots per row (sliding-window layers keep
    all slots too; the attention mask restricts them to their window)."""

    k: tuple[jax.Array, ...]  # per layer, B x S x K x E
    v: tuple[jax.Array, ...]
    positions: jax.Array  # B x S
    segments: jax.Array  # B x S
    index: jax.Array  # int32 scalar


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    dt = compute_dtype(cfg)
    return KVCache(k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
                   positions=jnp.zeros((batch, length), jnp.int32),
                   segments=jnp.zeros((batch, length), jnp.int32),
                   index=jnp.zeros((), jnp.int32))

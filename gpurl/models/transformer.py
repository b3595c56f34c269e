"""One decoder-only transformer (Flax NNX); model families differ only by `ModelConfig`.

Every parameter carries `logical_axes` metadata ("vocab", "embed", "mlp", "heads",
"kv_heads", "head_dim", "norm"); `gpurl.distributed.mesh` maps them to mesh axes.
Norms are RMSNorm with a (1 + w) scale and a zero init (Gemma's convention).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gpurl.config import ModelConfig
from gpurl.kernels.attention import attention, attention_mask, resolve

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
    def __init__(self, dim: int, eps: float, param_dtype: Any):
        self.scale = nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def rope(x_BxTxNxD: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (Su et al. 2021, RoFormer, eq. 34), half-split layout as in HF."""
    half = x_BxTxNxD.shape[-1] // 2
    freqs_F = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * freqs_F
    sin, cos = jnp.sin(angles_BxTxF)[:, :, None, :], jnp.cos(angles_BxTxF)[:, :, None, :]
    x1, x2 = jnp.split(x_BxTxNxD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, k, hd, pd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.param_dtype
        self.q = _param(rngs, (d, h, hd), ("embed", "heads", "head_dim"), cfg.init_std, pd)
        self.k = _param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std, pd)
        self.v = _param(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), cfg.init_std, pd)
        self.o = _param(rngs, (h, hd, d), ("heads", "head_dim", "embed"), cfg.init_std, pd)
        self.theta = cfg.rope_theta
        self.scale = 1.0 / math.sqrt(hd)
        self.implementation = resolve(cfg.attention)

    def __call__(self, x_BxTxD: jax.Array, positions_BxT: jax.Array,
                 segments_BxT: jax.Array) -> jax.Array:
        dt = x_BxTxD.dtype
        q = rope(jnp.einsum("btd,dhe->bthe", x_BxTxD, self.q[...].astype(dt)), positions_BxT, self.theta)
        k = rope(jnp.einsum("btd,dke->btke", x_BxTxD, self.k[...].astype(dt)), positions_BxT, self.theta)
        v = jnp.einsum("btd,dke->btke", x_BxTxD, self.v[...].astype(dt))
        mask = attention_mask(positions_BxT, positions_BxT, segments_BxT, segments_BxT)
        out_BxTxHxE = attention(q, k, v, mask, scale=self.scale, implementation=self.implementation)
        return jnp.einsum("bthe,hed->btd", out_BxTxHxE, self.o[...].astype(dt))


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
        h_BxTxF = self.act(x_BxTxD @ self.gate[...].astype(dt)) * (x_BxTxD @ self.up[...].astype(dt))
        return h_BxTxF @ self.down[...].astype(dt)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BxTxD, positions_BxT, segments_BxT):
        x_BxTxD = x_BxTxD + self.attn(self.attn_norm(x_BxTxD), positions_BxT, segments_BxT)
        return x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD))


class Transformer(nnx.Module):
    """tokens, positions, segment ids (0 = padding) -> next-token logits B x T x V."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = compute_dtype(cfg)
        # Embedding std 1/sqrt(D) so that the sqrt(D) scaling gives unit-scale inputs.
        emb_std = 1.0 / math.sqrt(cfg.d_model) if cfg.scale_embeddings else cfg.init_std
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), emb_std,
                            cfg.param_dtype)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                  cfg.init_std, cfg.param_dtype)

    def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
                 segments_BxT: jax.Array) -> jax.Array:
        table_VxD = self.embed[...].astype(self.dtype)
        x_BxTxD = jnp.take(table_VxD, tokens_BxT, axis=0)
        if self.cfg.scale_embeddings:
            x_BxTxD = x_BxTxD * jnp.asarray(math.sqrt(self.cfg.d_model), self.dtype)
        for block in self.blocks:
            x_BxTxD = block(x_BxTxD, positions_BxT, segments_BxT)
        x_BxTxD = self.final_norm(x_BxTxD)
        if self.cfg.tie_embeddings:
            return jnp.einsum("btd,vd->btv", x_BxTxD, table_VxD)
        return x_BxTxD @ self.lm_head[...].astype(self.dtype)

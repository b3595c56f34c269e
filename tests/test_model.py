"""The decoder: causal, packing-aware, GQA consistent, every parameter named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.kernels.attention import attention
from gpurl.models import model_spec

SPEC = model_spec(make_config(model=TINY_MODEL).model)
PARAMS = jax.jit(lambda: SPEC.init(0))()
APPLY = jax.jit(SPEC.apply)


def _inputs(tokens):
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    return tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)


def test_every_parameter_has_logical_axes_of_its_rank():
    shapes = jax.tree.leaves(SPEC.abstract_params)
    axes = jax.tree.leaves(SPEC.logical_axes, is_leaf=lambda x: isinstance(x, tuple))
    assert len(shapes) == len(axes) > 10
    for shape, names in zip(shapes, axes):
        assert len(names) == len(shape.shape)


def test_causal_future_tokens_do_not_change_past_logits():
    rng = np.random.default_rng(0)
    a = rng.integers(3, 259, (1, 12))
    b = a.copy()
    b[0, 7:] = rng.integers(3, 259, 5)
    la, lb = APPLY(PARAMS, *_inputs(a)), APPLY(PARAMS, *_inputs(b))
    np.testing.assert_allclose(la[0, :7], lb[0, :7], atol=1e-5)
    assert np.abs(la[0, 7:] - lb[0, 7:]).max() > 1e-3


def test_packed_row_equals_separate_rows():
    rng = np.random.default_rng(1)
    x, y = rng.integers(3, 259, 5), rng.integers(3, 259, 7)
    packed = jnp.asarray(np.concatenate([x, y, [0, 0, 0, 0]])[None], jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(5), np.arange(7), np.zeros(4)])[None], jnp.int32)
    segments = jnp.asarray(np.concatenate([np.ones(5), 2 * np.ones(7), np.zeros(4)])[None], jnp.int32)
    logits = APPLY(PARAMS, packed, positions, segments)
    np.testing.assert_allclose(logits[0, :5], APPLY(PARAMS, *_inputs(x[None]))[0], atol=1e-5)
    np.testing.assert_allclose(logits[0, 5:12], APPLY(PARAMS, *_inputs(y[None]))[0], atol=1e-5)
    assert np.isfinite(np.asarray(logits)).all()  # padding rows stay finite


def test_grouped_query_attention_equals_repeated_heads():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(2, 6, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 6, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 6, 2, 8)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    seg = jnp.ones((2, 6), jnp.int32)
    gqa = attention(q, k, v, pos, seg, pos, seg, scale=0.3)
    mha = attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), pos, seg, pos, seg,
                    scale=0.3)
    np.testing.assert_allclose(gqa, mha, atol=1e-6)
    # NumPy reference for head 0 of query group 0, row 0: softmax(q k^T * scale) v, causal.
    s = np.asarray(q[0, :, 0] @ k[0, :, 0].T) * 0.3
    s = np.where(np.tril(np.ones((6, 6), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(gqa[0, :, 0], p @ np.asarray(v[0, :, 0]), atol=1e-5)


# ---------------------------------------------------------------- the scanned stack

# Gemma 3's pattern on a tiny stack: 2 sliding-window layers with their own RoPE base per
# global one, a window shorter than the sequence, 5 layers (the pattern does not divide them).
PATTERNED = dict(TINY_MODEL, family="gemma3", num_layers=5, post_norms=True, qk_norm=True,
                 sliding_window=3, global_every=3, rope_local_theta=100.0, rope_theta=1e4)


def _unrolled_logits(spec, params, tokens, positions, segments):
    """The same model layer by layer in Python (the reference the scan must equal)."""
    from flax import nnx

    from gpurl.models.transformer import layer_kinds

    model = nnx.merge(spec.graphdef, params)
    graphdef, stacked = nnx.split(model.blocks)
    x = jnp.take(model.embed[...], tokens, axis=0) * jnp.sqrt(jnp.float32(spec.cfg.d_model))
    for i, kind in enumerate(layer_kinds(spec.cfg)[1]):
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
        x, _, _, _ = block(x, positions, segments, jnp.int32(kind), jnp.int32(i), None)
    return model.logits(model.final_norm(x))


def _loss(apply, tokens, positions, segments):
    def loss(params):
        logits = apply(params, tokens, positions, segments)
        return jax.nn.log_softmax(logits)[..., 5].mean()
    return loss


@pytest.mark.slow
def test_scanned_layers_equal_unrolled_ones_and_every_remat_policy_equals_none():
    inputs = _inputs(np.random.default_rng(3).integers(3, 259, (2, 11)))
    for fields in (PATTERNED,):  # one kind alone: the transformers parity tests
        specs = {r: model_spec(make_config(model=dict(fields, remat=r)).model)
                 for r in ("none", "full", "dots", "qkv")}
        params = jax.jit(lambda: specs["none"].init(0))()
        assert params["blocks"]["attn"]["q"].shape[0] == specs["none"].cfg.num_layers
        want_loss, want_grads = jax.jit(jax.value_and_grad(
            _loss(lambda *a: _unrolled_logits(specs["none"], *a), *inputs)))(params)
        for remat, spec in specs.items():
            got_loss, got_grads = jax.jit(jax.value_and_grad(_loss(spec.apply, *inputs)))(params)
            np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, err_msg=remat)
            for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=remat)

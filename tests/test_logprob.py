"""Chunked log-probabilities: parity with the whole-logits reference (values and
gradients), the reference against float64 NumPy, a real gpurl model against
`algorithms.forward.token_logprobs`, batch sharding, and the memory the chunking saves."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import TINY_MODEL
from gpurl.kernels.logprob import (chunked_token_logprobs, default_chunk_size,
                                   token_logprobs_reference)

B, T, D, V = 3, 7, 16, 300


def linear_head(w_VxD: jax.Array, hidden_NxD: jax.Array) -> jax.Array:
    return hidden_NxD @ w_VxD.T


def softcap_head(w_VxD: jax.Array, hidden_NxD: jax.Array, cap: float = 3.0) -> jax.Array:
    return cap * jnp.tanh(linear_head(w_VxD, hidden_NxD) / cap)


def tiny(dtype=jnp.float32, b: int = B, t: int = T):
    """Head weight, hidden states, targets, loss weights (NumPy: eager jnp ops compile)."""
    rng = np.random.default_rng(0)
    hidden_BxTxD = jnp.asarray(rng.standard_normal((b, t, D), np.float32), dtype)
    w_VxD = jnp.asarray(rng.standard_normal((V, D), np.float32), dtype)
    targets_BxT = rng.integers(0, V, (b, t), dtype=np.int32)
    weights_BxT = rng.uniform(size=(b, t)).astype(np.float32) * (np.arange(t) < t - 2)  # 0 tail
    return w_VxD, hidden_BxTxD, targets_BxT, weights_BxT


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=("temperature", "chunk_size"))
def value_and_grads(impl, head, w_VxD, hidden_BxTxD, targets_BxT, weights_BxT, **kw):
    def loss(w, h):
        logp_BxT, entropy_BxT = impl(head, w, h, targets_BxT, **kw)
        return (weights_BxT * logp_BxT).sum(), (logp_BxT, entropy_BxT)

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w_VxD, hidden_BxTxD)
    return out, grads


def assert_parity(head, chunk_size, atol=1e-5, dtype=jnp.float32, **kw):
    args = (head,) + tiny(dtype)
    ref = value_and_grads(token_logprobs_reference, *args, **kw)
    got = value_and_grads(chunked_token_logprobs, *args, chunk_size=chunk_size, **kw)
    for name, r, g in zip(("logp", "entropy", "grad w", "grad hidden"), ref[0] + ref[1],
                          got[0] + got[1]):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   atol=atol, rtol=atol, err_msg=name)


# B*T = 21 tokens: 1 token per row (7 chunks), 2 per row (4 chunks, 1 padded token per
# row), and None: the default, one chunk here.
@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_chunked_matches_reference(chunk_size):
    assert_parity(linear_head, chunk_size)


@pytest.mark.parametrize("head,temperature", [(linear_head, 0.6), (softcap_head, 1.7)])
def test_temperature_and_final_softcap(head, temperature):
    assert_parity(head, 4, temperature=temperature)


def test_bfloat16_head():
    assert_parity(linear_head, 4, atol=2e-2, dtype=jnp.bfloat16)


def test_reference_against_numpy_float64():
    w_VxD, hidden_BxTxD, targets_BxT, _ = tiny()
    logp, entropy = token_logprobs_reference(linear_head, w_VxD, hidden_BxTxD, targets_BxT, 0.6)
    z = np.einsum("btd,vd->btv", np.float64(hidden_BxTxD), np.float64(w_VxD)) / 0.6
    logq = z - z.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    np.testing.assert_allclose(logp, np.take_along_axis(logq, np.asarray(targets_BxT)[..., None],
                                                        -1)[..., 0], atol=1e-4)
    np.testing.assert_allclose(entropy, -(np.exp(logq) * logq).sum(-1), atol=1e-4)


@pytest.mark.slow
def test_real_model_matches_training_logprobs():
    from gpurl.algorithms.forward import token_logprobs
    from gpurl.config import ModelConfig
    from gpurl.models import model_spec

    spec = model_spec(ModelConfig(**TINY_MODEL))
    # Everything from NumPy: spec.init builds the NNX module eagerly (2.4 s) and every eager
    # jnp op compiles (0.2 s each), of this file's 20 s budget.
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(0.2 * rng.standard_normal(a.shape), a.dtype),
                          spec.abstract_params)
    segments = np.ones((2, 9), np.int32)
    segments[1, 5:] = 2  # a packed row
    batch = {"tokens": rng.integers(0, 259, (2, 9), dtype=np.int32),
             "positions": np.broadcast_to(np.arange(9, dtype=np.int32), (2, 9)),
             "segment_ids": segments}
    tokens = batch["tokens"]

    def chunked(params):
        hidden_BxTxD, _ = spec.hidden(params, tokens, batch["positions"], batch["segment_ids"])
        logp_BxT, _ = chunked_token_logprobs(spec.logits, params, hidden_BxTxD[:, :-1],
                                             tokens[:, 1:], temperature=0.8, chunk_size=5)
        return logp_BxT.mean(), logp_BxT

    def reference(params):
        logp_BxT = token_logprobs(spec.apply, params, batch, temperature=0.8)
        return logp_BxT.mean(), logp_BxT

    (_, got), got_grads = jax.jit(jax.value_and_grad(chunked, has_aux=True))(params)
    (_, ref), ref_grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    np.testing.assert_allclose(got, ref, atol=1e-5)
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-7),
                 got_grads, ref_grads)


def test_batch_sharded_rows_stay_sharded():
    """Rows split over 4 devices: same numbers, and no all-gather of the hidden states."""
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("data",))  # like distributed.trainer_mesh
    w_VxD, hidden_BxTxD, targets_BxT, weights_BxT = tiny(b=4, t=6)
    rows = NamedSharding(mesh, P("data"))
    sharded = [jax.device_put(x, rows) for x in (hidden_BxTxD, targets_BxT, weights_BxT)]
    args = (chunked_token_logprobs, linear_head, w_VxD)
    ref = value_and_grads(*args, hidden_BxTxD, targets_BxT, weights_BxT, chunk_size=8)
    compiled = value_and_grads.lower(*args, *sharded, chunk_size=8).compile()
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, atol=1e-5),
                 compiled(w_VxD, *sharded), ref)
    assert "all-gather" not in compiled.as_text()


def test_chunking_bounds_backward_memory():
    """Compiled (never run) forward + backward: the scratch memory of the chunked version
    does not grow with the tokens, the reference's holds several N x V fp32 arrays."""
    w = jax.ShapeDtypeStruct((32768, 64), jnp.float32)

    def temp_bytes(impl, n, **kw):
        h = jax.ShapeDtypeStruct((4, n // 4, 64), jnp.float32)
        t = jax.ShapeDtypeStruct((4, n // 4), jnp.int32)
        f = jax.value_and_grad(lambda w, h, t: impl(linear_head, w, h, t, **kw)[0].mean(), (0, 1))
        return jax.jit(f).lower(w, h, t).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = 1024 * 32768 * 4
    assert temp_bytes(token_logprobs_reference, 1024) > 2 * logits_bytes
    small, large = (temp_bytes(chunked_token_logprobs, n, chunk_size=64) for n in (1024, 4096))
    assert large < small + 4 * 4096 * 64 * 4 < logits_bytes / 4  # grows by O(N x D) only


def test_default_chunk_size_and_bad_chunk():
    assert default_chunk_size(262144) == 256 and default_chunk_size(32000) == 2048
    assert default_chunk_size(10**9) == 16
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(linear_head, *tiny()[:3], chunk_size=0)


def entropy_bonus_grads(impl, head, w_VxD, hidden_BxTxD, targets_BxT, weights_BxT, **kw):
    """Gradients of a PPO-style loss with an entropy bonus: sum w (log p + 0.3 H)."""
    def loss(w, h):
        logp_BxT, entropy_BxT = impl(head, w, h, targets_BxT, differentiable_entropy=True, **kw)
        return (weights_BxT * (logp_BxT + 0.3 * entropy_BxT)).sum(), (logp_BxT, entropy_BxT)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(w_VxD, hidden_BxTxD)


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_differentiable_entropy_chunked_matches_reference(dtype, atol):
    args = (softcap_head,) + tiny(dtype)
    (_, ref), ref_grads = entropy_bonus_grads(token_logprobs_reference, *args, temperature=0.7)
    (_, got), got_grads = entropy_bonus_grads(chunked_token_logprobs, *args, temperature=0.7,
                                              chunk_size=4)
    for name, g, r in zip(("logp", "entropy", "grad w", "grad hidden"), got + got_grads,
                          ref + ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   atol=atol, rtol=atol, err_msg=name)
    # The metric-only default gives the same values and the gradient of log p alone.
    _, metric_grads = value_and_grads(chunked_token_logprobs, *args, temperature=0.7,
                                      chunk_size=4)
    assert np.abs(np.asarray(metric_grads[1], np.float32)
                  - np.asarray(got_grads[1], np.float32)).max() > 1e-3


def test_entropy_gradient_matches_closed_form_and_ignores_minus_inf_logits():
    """dH/dz = -p (log p + H) (float64 NumPy); a -inf logit (a masked token) gives no nan."""
    rng = np.random.default_rng(4)
    z_NxV = rng.standard_normal((5, 11)).astype(np.float32) * 3
    z_NxV[0, 3] = -np.inf
    identity = lambda params, hidden: hidden  # noqa: E731  (the hidden states are the logits)

    def entropy_sum(z):
        return token_logprobs_reference(identity, None, z[None], jnp.zeros((1, 5), jnp.int32),
                                        differentiable_entropy=True)[1].sum()

    got = np.asarray(jax.jit(jax.grad(entropy_sum))(jnp.asarray(z_NxV)))
    z = np.float64(z_NxV)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    p = np.exp(logp)
    entropy = -(p * np.where(p > 0, logp, 0)).sum(-1, keepdims=True)
    want = -p * (np.where(p > 0, logp, 0) + entropy)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_bfloat16_model_head_is_float32(tied):
    """A bfloat16 model's head (trainer chunks, sampler, teacher: `Transformer.logits`)
    accumulates and writes float32: its log-probs equal float64 NumPy of the same
    bfloat16 operands within float32 rounding. Rounded to bfloat16 (before the fix), logits
    of magnitude 10-30 were off by up to 0.125 and the log-probs by as much."""
    from gpurl.config import ModelConfig
    from gpurl.models import model_spec

    spec = model_spec(ModelConfig(**dict(TINY_MODEL, dtype="bfloat16", tie_embeddings=tied)))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
                          spec.abstract_params)
    head = "embed" if tied else "lm_head"
    w = np.asarray(params[head], np.float32) * 1.5  # logits of magnitude 10-30
    params[head] = jnp.asarray(w)
    hidden_BxTxD = jnp.asarray(rng.standard_normal((2, 5, 32)), jnp.bfloat16)
    targets_BxT = rng.integers(0, 259, (2, 5), dtype=np.int32)
    logits = jax.jit(spec.logits)(params, hidden_BxTxD)
    assert logits.dtype == jnp.float32
    logp, _ = jax.jit(lambda p, h: chunked_token_logprobs(spec.logits, p, h, targets_BxT,
                                                          chunk_size=4))(params, hidden_BxTxD)
    w_DxV = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64)
    z = np.asarray(hidden_BxTxD, np.float64) @ (w_DxV.T if tied else w_DxV)
    assert 10 < np.abs(z).max() < 50
    logq = z - z.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    ref = np.take_along_axis(logq, targets_BxT[..., None], -1)[..., 0]
    # float32 rounding of 32-term sums of magnitude ~30 and of the log-sum-exp
    np.testing.assert_allclose(logp, ref, rtol=0, atol=32 * np.finfo(np.float32).eps * 50)


def test_the_head_chunk_is_the_logits_budget_of_every_row_shard():
    """A chunk of the chunked head counts tokens over the whole batch; its default budget
    is one device's logits, so rows split over 4 devices get 4x the tokens per chunk (each
    device then reads the head's weight once per `default_chunk_size` of its own tokens,
    not once per quarter of it)."""
    import jax
    from gpurl.algorithms.forward import head_chunk
    from gpurl.config import MeshConfig
    from gpurl.distributed.mesh import batch_sharding, trainer_mesh
    from gpurl.kernels.logprob import default_chunk_size
    from gpurl.models import model_spec
    from gpurl.models.layers import sharded_rows
    from conftest import make_config

    spec = model_spec(make_config().model)
    one = default_chunk_size(spec.cfg.vocab_size)
    assert head_chunk(spec) == one and head_chunk(spec, 48) == 48
    rules = MeshConfig().train_rules
    for mesh, shards in (({"data": 4}, 4), ({"data": 2, "tp": 2}, 2), ({"data": 1, "fsdp": 4}, 4)):
        rows = batch_sharding(trainer_mesh(MeshConfig(**mesh), jax.devices()[:4]), rules)
        with sharded_rows(rows, rules):
            assert head_chunk(spec) == one * shards, mesh
            assert head_chunk(spec, share=2) == max(one // 2, 16) * shards, mesh

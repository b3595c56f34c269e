"""Attention kernels: every implementation equals the jnp reference (outputs and
gradients) over shapes, dtypes, GQA ratios, windows, soft-caps, padding and packing; the
reference equals a float64 NumPy transcription and, where it skips keys past the causal
diagonal, a plain masked softmax; the Pallas kernels (interpreted here) lower to Triton
for GPUs; `auto` and `cudnn` choose and fall back as documented; a model
gives the same logits and decode steps with each implementation."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from conftest import TINY_MODEL, make_config
from gpurl.config import ConfigError, ModelConfig
from gpurl.kernels import attention as attn, platform
from gpurl.kernels.paged_attention import paged_decode_attention
from gpurl.kernels.pallas_attention import flash_attention
from gpurl.kernels.pallas_paged import paged_decode_attention as paged_pallas
from gpurl.models import init_cache, model_spec
from gpurl.models.layers import sharded_rows

ON_GPU = jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class Case:
    b: int = 2
    t: int = 20
    s: int = 20  # > t: a KV cache whose first s - t slots hold earlier tokens
    h: int = 4
    k: int = 2
    d: int = 8
    dtype: str = "float32"
    window: int | None = None
    softcap: float | None = None
    packed: bool = False  # row 1 holds two segments; row 0 ends in padding


def inputs(c: Case, seed: int = 0):
    """q, k, v and (q pos, q seg, kv pos, kv seg) with padding, packing or empty slots."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(c.dtype)
    q = jnp.asarray(rng.standard_normal((c.b, c.t, c.h, c.d)), dt)
    k = jnp.asarray(rng.standard_normal((c.b, c.s, c.k, c.d)), dt)
    v = jnp.asarray(rng.standard_normal((c.b, c.s, c.k, c.d)), dt)
    kv_pos = np.tile(np.arange(c.s), (c.b, 1))
    kv_seg = np.ones((c.b, c.s), np.int64)
    kv_seg[0, c.s - 3:] = 0  # padding (or empty cache slots) at the end of row 0
    if c.packed:
        cut = c.s // 2 + 1
        kv_pos[-1, cut:] = np.arange(c.s - cut)
        kv_seg[-1, cut:] = 2
    as_i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return (q, k, v), tuple(map(as_i32, (kv_pos[:, c.s - c.t:], kv_seg[:, c.s - c.t:],
                                         kv_pos, kv_seg)))


def value_and_grads(fn, c: Case, seed: int = 0):
    qkv, mask = inputs(c, seed)

    def loss(q, k, v):
        o = fn(q, k, v, *mask, scale=0.4, softcap=c.softcap, window=c.window)
        return jnp.sum(o.astype(jnp.float32) * jnp.cos(o.astype(jnp.float32))), o

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*qkv)
    return out, grads


def assert_close(got, want, dtype: str, what: str) -> None:
    tol = 2e-2 if dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol * max(1.0, float(np.abs(want.astype(np.float32)).max())),
                               rtol=tol, err_msg=what)


def small_blocks(*args, **kw):
    # 16-token blocks give several blocks per axis here, so the online softmax, the block
    # skipping and the backward loops all see more than one block.
    return flash_attention(*args, **kw, block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16,
                           interpret=True)


def reference(*args, **kw):
    return attn.attention(*args, **kw, implementation="xla")


CASES = {
    "mha": Case(h=2, k=2),
    "gqa-window-softcap-packed": Case(window=5, softcap=2.0, packed=True),
    "mqa-bf16-softcap": Case(h=4, k=1, d=16, dtype="bfloat16", softcap=3.0, t=33, s=33),
    "gqa3-d12-packed": Case(h=6, k=2, d=12, packed=True, t=17, s=17),
    "prefill-into-cache": Case(t=7, s=24, window=9),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pallas_matches_reference(name):
    c = CASES[name]
    want, want_grads = value_and_grads(reference, c)
    got, got_grads = value_and_grads(small_blocks, c)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, c.dtype, "output")
    for what, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
        assert_close(g, w, c.dtype, what)


@pytest.mark.parametrize("case", [Case(t=1, s=21, h=8, k=2, window=6),
                                  Case(t=1, s=40, h=4, k=1, d=16, dtype="bfloat16", softcap=5.0)])
def test_pallas_decode_step_matches_reference(case):
    """One query token against a cache with empty slots (the folded-group decode path)."""
    qkv, mask = inputs(case)
    kw = dict(scale=0.4, softcap=case.softcap, window=case.window)
    want = jax.jit(lambda *a: reference(*a, **kw))(*qkv, *mask)
    got = jax.jit(lambda *a: attn.attention(*a, **kw, implementation="pallas"))(*qkv, *mask)
    assert_close(got, want, case.dtype, "decode output")


def test_reference_matches_numpy_float64():
    c = Case(window=4, softcap=2.0, packed=True, t=6, s=9)
    (q, k, v), (qp, qs, kp, ks) = inputs(c)
    got = attn.attention(q, k, v, qp, qs, kp, ks, scale=0.4, softcap=2.0, window=4)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    qp, qs, kp, ks = (np.asarray(x) for x in (qp, qs, kp, ks))
    for b in range(c.b):
        for h in range(c.h):
            logits = 2.0 * np.tanh(q[b, :, h] @ k[b, :, h // 2].T * 0.4 / 2.0)
            d = qp[b][:, None] - kp[b][None, :]
            visible = (d >= 0) & (d < 4) & (qs[b][:, None] == ks[b][None, :]) & (ks[b] != 0)
            p = np.where(visible, np.exp(logits - logits.max(-1, keepdims=True)), 0.0)
            want = p / np.maximum(p.sum(-1, keepdims=True), 1e-300) @ v[b, :, h // 2]
            np.testing.assert_allclose(np.asarray(got[b, :, h]), want, atol=1e-5)


def test_pallas_kernels_lower_to_triton():
    """CI has no GPU: lowering for CUDA still checks every primitive has a Triton rule."""
    def grads(*args):
        def loss(q, k, v):
            return flash_attention(q, k, v, *args[3:], scale=0.1, softcap=30.0, window=64
                                   ).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(*args[:3])

    def decode(*args):
        return flash_attention(*args, scale=0.1)

    bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    for fn, t, s, kernels in ((grads, 96, 96, 3), (decode, 1, 80, 1)):
        args = (bf16(2, t, 8, 256), bf16(2, s, 1, 256), bf16(2, s, 1, 256),
                i32(2, t), i32(2, t), i32(2, s), i32(2, s))
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == kernels


def test_auto_picks_xla_on_cpu_and_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(attn, "_logged", set())
    with caplog.at_level(logging.INFO, logger=attn.__name__):
        assert attn.resolve("auto", "cpu") == "xla"
        assert attn.resolve("auto", "cpu") == "xla"
    assert len(caplog.records) == 1 and "auto -> xla on cpu" in caplog.records[0].message
    with platform.target("gpu"):  # a Hopper GPU (test_gpu_plan.py: older ones)
        assert attn.resolve("auto") == "cudnn"
        assert attn.resolve("pallas") == "pallas"


def test_cudnn_off_gpu_and_unknown_names_are_one_sentence_errors():
    with pytest.raises(ValueError, match=r"needs a CUDA GPU .* use model.attention=auto or xla\.$"):
        attn.resolve("cudnn", "cpu")
    with pytest.raises(ValueError, match=r"unknown; use one of auto, xla, cudnn, pallas\.$"):
        attn.resolve("flash", "cpu")
    with pytest.raises(ConfigError, match="model.attention"):
        ModelConfig(attention="flash")


def test_cudnn_calls_it_cannot_express_fall_back_to_pallas(caplog, monkeypatch):
    """Decided per call from static facts; the fallback runs (interpreted) and is logged."""
    unsupported = attn._cudnn_unsupported
    q, k = jnp.zeros((1, 4, 2, 64), jnp.bfloat16), jnp.zeros((1, 4, 1, 64), jnp.bfloat16)
    assert unsupported(q, k, None, True) == ""
    assert "soft-cap" in unsupported(q, k, 50.0, True)
    assert "KV cache" in unsupported(q, k, None, False)
    assert "float32" in unsupported(q.astype(jnp.float32), k, None, True)
    assert "head width" in unsupported(jnp.zeros((1, 4, 2, 12), jnp.bfloat16), k, None, True)
    c = Case(t=9, s=9, softcap=2.0)
    monkeypatch.setattr(attn, "_logged", set())
    with caplog.at_level(logging.INFO, logger=attn.__name__):
        qkv, mask = inputs(c)
        got = attn.attention(*qkv, *mask, scale=0.4, softcap=2.0, contiguous=True,
                             implementation="cudnn")
    assert "cudnn -> pallas" in caplog.text
    assert_close(got, reference(*qkv, *mask, scale=0.4, softcap=2.0), c.dtype, "fallback")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="cuDNN attention needs a CUDA GPU (CPU CI tests its "
                    "fallback and lowering only)")
@pytest.mark.parametrize("window", [None, 7])
def test_cudnn_matches_reference(window):
    c = Case(t=64, s=64, h=8, k=2, d=64, dtype="bfloat16", window=window, packed=True)

    def cudnn(*args, **kw):
        return attn.attention(*args, **kw, contiguous=True, implementation="cudnn")

    want, want_grads = value_and_grads(reference, c)
    got, got_grads = value_and_grads(cudnn, c)
    assert_close(got, want, c.dtype, "output")
    for what, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
        assert_close(g, w, c.dtype, what)


# Gemma 2-like tiny model: GQA, a sliding window on layer 0, attention soft-cap.
MODEL = dict(TINY_MODEL, sliding_window=4, global_every=2, attn_softcap=20.0)


def _spec(implementation: str):
    return model_spec(make_config(model=dict(MODEL, attention=implementation)).model)


@pytest.mark.slow
def test_model_logits_and_decode_equal_for_each_implementation():
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(3, 259, (2, 10)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))
    segments = jnp.asarray([[1] * 10, [1] * 7 + [0] * 3], jnp.int32)
    spec = _spec("xla")
    params = jax.jit(lambda: spec.init(0))()
    # One prefilled cache (row 1 has 3 padded slots) serves both decode steps.
    _, cache = jax.jit(spec.hidden)(params, tokens, positions, segments,
                                    init_cache(spec.cfg, 2, 12))

    def run(implementation: str):
        spec = _spec(implementation)

        @jax.jit
        def forward_and_decode(params, cache):
            logits = spec.apply(params, tokens, positions, segments)
            step, _ = spec.hidden(params, tokens[:, :1], jnp.asarray([[10], [7]], jnp.int32),
                                  jnp.ones((2, 1), jnp.int32), cache)
            return logits, spec.logits(params, step)

        return [np.asarray(x) for x in forward_and_decode(params, cache)]

    want, got = run("xla"), run("pallas")
    for what, g, w in zip(("logits", "decode logits"), got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=what)


# ------------------------------------------------ causal key skipping of `xla` (long calls)


def plain(q, k, v, q_pos, q_seg, kv_pos, kv_seg, *, scale, softcap, window):
    """Every query against every key in one masked softmax: no chunks, nothing skipped."""
    mask_BxTxS = attn.attention_mask(q_pos, kv_pos, q_seg, kv_seg, window)
    return attn._xla_attention(q, k, v, mask_BxTxS, scale, softcap)


def matmul_flops(jaxpr) -> int:
    """FLOPs of a jaxpr's dot_generals, nested jaxprs included, a scan's body (`lax.map`)
    counted once per iteration; XLA's cost analysis counts a loop body only once."""
    flops = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(
                np.prod([lhs[d] for d in contracting]))
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        flops += times * sum(matmul_flops(sub) for sub in jaxprs_in_params(eqn.params))
    return flops


@pytest.mark.slow
@pytest.mark.parametrize("window,softcap", [(None, None), (40, 2.0)])
def test_long_self_attention_skips_only_masked_keys(monkeypatch, window, softcap):
    """With several query chunks, `contiguous` self-attention computes each query group
    against its static key range only: outputs and gradients equal the plain masked
    softmax (packed row, padded row, window), at clearly fewer FLOPs than dense chunks."""
    c = Case(t=600, s=600, h=4, k=2, d=8, window=window, softcap=softcap, packed=True)
    # 32-query dense chunks (19 of them, the last padded); 16 groups of 38 queries (the last
    # of 30), the causal ones with the longest key prefixes in two chunks of 19 as well.
    monkeypatch.setattr(attn, "CHUNK_BYTES", 32 * 4 * c.b * c.h * c.s)
    assert attn.query_chunk(c.b, c.t, c.h, c.s) == 32
    groups = attn.causal_groups(c.t, window)
    assert len(groups) == attn.CAUSAL_GROUPS and groups[-1][1] == c.t
    chunked = [attn.query_chunk(c.b, q1 - q0, c.h, q1 - k0) < q1 - q0 for q0, q1, k0 in groups]
    assert any(chunked) == (window is None)

    def xla(contiguous):
        return lambda *a, **kw: attn.attention(*a, **kw, contiguous=contiguous)

    want, want_grads = value_and_grads(plain, c)
    for contiguous in (True, False):
        got, got_grads = value_and_grads(xla(contiguous), c)
        for what, g, w in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(w).max()),
                                       err_msg=f"{what}, contiguous={contiguous}")

    qkv, mask = inputs(c)

    def flops(contiguous):
        def loss(q, k, v):
            return xla(contiguous)(q, k, v, *mask, scale=0.4, softcap=softcap,
                                   window=window).sum()
        return matmul_flops(jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(*qkv).jaxpr)

    # Causal: about (G + 1) / 2G = 53% of dense for 16 groups; the window keeps ~13%.
    assert flops(True) < (0.6 if window is None else 0.3) * flops(False)


@pytest.mark.slow
def test_skipping_model_step_equals_dense_under_remat_scan_and_sharding(monkeypatch):
    """The Gemma 2-like tiny model (a windowed and a global layer in a scanned, fully
    rematerialized stack), rows sharded over 4 devices, packed rows: the loss and the
    gradients are the same whether attention runs as one dense chunk or skips keys."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("data",))
    rows, replicated = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*p))
                        for p in (("data",), ()))
    spec = model_spec(make_config(model=dict(MODEL, remat="full")).model)
    params = jax.device_put(jax.jit(lambda: spec.init(0))(), replicated)
    t = 64
    tokens = np.random.default_rng(5).integers(3, 259, (4, t))
    segments = np.ones((4, t), np.int32)
    segments[1, 40:], segments[2, 50:] = 2, 0  # a packed row, a padded one
    positions = np.tile(np.arange(t), (4, 1))
    positions[1, 40:] = np.arange(t - 40)
    batch = [jax.device_put(jnp.asarray(x, jnp.int32), rows) for x in (tokens, positions, segments)]

    def loss(params, tokens, positions, segments):
        with sharded_rows(rows):
            logits = spec.apply(params, tokens, positions, segments)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 7] * (segments != 0))

    monkeypatch.setattr(attn, "CAUSAL_GROUPS", 4)  # 4 groups of 16 queries: fewer to compile
    results = {}
    for name, chunk_bytes in (("dense", attn.CHUNK_BYTES), ("skipping", 16 * 4 * 4 * 4 * t)):
        # Read when traced, so each setting jits a new function (no cached trace).
        monkeypatch.setattr(attn, "CHUNK_BYTES", chunk_bytes)
        results[name] = jax.jit(jax.value_and_grad(lambda *a: loss(*a)))(params, *batch)
    assert attn.query_chunk(4, t, 4, t) == 16  # 4 chunks: skipping ran
    (want, want_grads), (got, got_grads) = results["dense"], results["skipping"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ paged decode attention


def _paged_case(seed: int = 0):
    """2 shards x 3 rows of ragged lengths (1..40 tokens) in a pool of 16-token blocks,
    4 query heads over 2 kv heads, tables listing scattered blocks (two rows share one)."""
    rng = np.random.default_rng(seed)
    a, b, l, y, u, kv, e, h = 2, 3, 2, 12, 16, 2, 16, 4
    k = jnp.asarray(rng.normal(size=(a, l, y, u, kv, e)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(a, l, y, u, kv, e)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(a * b, h, e)), jnp.float32)
    lengths = np.asarray([0, 17, 39, 5, 31, 16], np.int32)
    table = np.stack([rng.permutation(np.arange(1, y))[:3] for _ in range(a * b)]).astype(np.int32)
    table[4, :1] = table[3, :1]  # a shared prompt block
    return q, k, v, jnp.asarray(table), jnp.asarray(lengths)


@pytest.mark.parametrize("window,softcap", [(None, None), (8, None), (None, 5.0)])
def test_paged_reference_matches_numpy(window, softcap):
    q, k, v, table, lengths = _paged_case()
    got = np.asarray(paged_decode_attention(q, k, v, jnp.int32(1), table, lengths, jnp.int32(3),
                                            scale=0.3, softcap=softcap, window=window))
    kn, vn, qn = np.asarray(k), np.asarray(v), np.asarray(q)
    for row in range(6):
        shard, n = row // 3, int(lengths[row])
        blocks = np.asarray(table[row])
        keys = kn[shard, 1][blocks].reshape(-1, 2, 16)[:n + 1]  # tokens 0..n
        values = vn[shard, 1][blocks].reshape(-1, 2, 16)[:n + 1]
        pos = np.arange(n + 1)
        seen = np.ones(n + 1, bool) if window is None else n - pos < window
        for head in range(4):
            s = qn[row, head] @ keys[:, head // 2].T * 0.3
            s = s if softcap is None else softcap * np.tanh(s / softcap)
            p = np.where(seen, np.exp(s - s[seen].max()), 0.0)
            want = p / p.sum() @ values[:, head // 2]
            np.testing.assert_allclose(got[row, head], want, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(None, None), (8, 5.0)])
def test_paged_pallas_matches_reference(window, softcap):
    q, k, v, table, lengths = _paged_case(1)
    kw = dict(scale=0.3, softcap=softcap, window=window)
    want = paged_decode_attention(q, k, v, jnp.int32(0), table, lengths, jnp.int32(3), **kw)
    got = paged_pallas(q, k, v, jnp.int32(0), table, lengths, **kw, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_paged_pallas_lowers_to_triton():
    """CI has no GPU: lowering for CUDA checks every primitive of the kernel has a Triton rule."""
    bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    fn = lambda q, k, v, t, n: paged_pallas(q, k, v, jnp.int32(0), t, n, scale=0.1, window=64)  # noqa: E731
    args = (bf16(4, 8, 256), bf16(2, 2, 32, 64, 1, 256), bf16(2, 2, 32, 64, 1, 256), i32(4, 8), i32(4))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") >= 1


def _shared_prefix_row():
    """One packed RL row (`gpurl.data.packing`): group 1's prefix (5 tokens) and branches
    of 6 and 4 tokens, group 2's prefix (3) and a branch of 5, then padding; each part's
    (slice, positions) as a sequence on its own would hold it."""
    from gpurl.kernels.segments import BRANCHES

    parts = [(BRANCHES, 0, 5), (BRANCHES + 1, 5, 6), (BRANCHES + 2, 5, 4),
             (2 * BRANCHES, 0, 3), (2 * BRANCHES + 1, 3, 5)]
    seg, pos = [], []
    for s, first, n in parts:
        seg += [s] * n
        pos += list(range(first, first + n))
    pad = 32 - len(seg)
    return (np.asarray([seg + [0] * pad], np.int32), np.asarray([pos + [0] * pad], np.int32),
            {"b1": ([0, 5], 6), "b2": ([0, 11], 4), "c1": ([15, 18], 5)})


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 4])
def test_shared_prefix_branches_attend_as_separate_sequences(window, monkeypatch):
    """Every branch of a packed row sees its group's prefix and itself: its outputs equal
    the plain causal attention of prefix + branch as one sequence (by position, so a
    window counts positions, not the other branches' slots between), for xla (dense and
    its key-skipping query groups) and, with the window, the Pallas kernels (forward and
    gradients)."""
    seg, pos, branches = _shared_prefix_row()
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 32, 4, 8)), jnp.float32) for _ in range(3))
    kw = dict(scale=0.4, softcap=None, window=window)
    row = (jnp.asarray(pos), jnp.asarray(seg), jnp.asarray(pos), jnp.asarray(seg))
    dense = attn.attention(q, k, v, *row, **kw, shared_prefix=True)
    for (prefix_start, branch_start), n in branches.values():
        plen = {0: 5, 15: 3}[prefix_start]
        idx = np.r_[prefix_start:prefix_start + plen, branch_start:branch_start + n]
        one = [jnp.asarray(np.arange(plen + n)[None], jnp.int32), jnp.ones((1, plen + n), jnp.int32)]
        alone = attn.attention(q[:, idx], k[:, idx], v[:, idx], one[0], one[1], one[0], one[1], **kw)
        np.testing.assert_allclose(dense[:, idx[plen:]], alone[:, plen:], atol=2e-6)
        np.testing.assert_allclose(dense[:, idx[:plen]], alone[:, :plen], atol=2e-6)
    monkeypatch.setattr(attn, "CHUNK_BYTES", 4 * 4 * 32 * 4)  # 4-query chunks: query groups
    grouped = attn.attention(q, k, v, *row, **kw, contiguous=True, shared_prefix=True)
    np.testing.assert_allclose(grouped, dense, atol=2e-6)

    if window is None:  # the Pallas kernels in interpret mode are slow: once, windowed
        return

    def loss(fn, q, k, v):
        o = fn(q, k, v, *row, **kw)
        return jnp.sum(o * jnp.cos(o)), o

    want = jax.value_and_grad(functools.partial(loss, reference), (0, 1, 2), has_aux=True)(q, k, v)
    got = jax.value_and_grad(functools.partial(loss, small_blocks), (0, 1, 2), has_aux=True)(q, k, v)
    assert_close(got[0][1], want[0][1], "float32", "pallas output")
    for what, g, w in zip(("dq", "dk", "dv"), got[1], want[1]):
        assert_close(g, w, "float32", f"pallas {what}")

"""The checks a person runs on a new GPU machine (tier `gpu`; skipped without a CUDA GPU;
`benchmarks/gpu.sh` runs them first): the Pallas kernels compiled by Triton against the
xla reference, forward and backward, and the paged decode kernel; the real Gemma 3 270M's
bf16 logits against its fp32 logits. cuDNN attention's parity is
`tests/test_attention.py::test_cudnn_matches_reference` (also in the tier).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import xla_flags
from gpurl.config import MeshConfig, ModelConfig
from gpurl.distributed.mesh import trainer_mesh, tree_shardings
from gpurl.kernels.paged_attention import paged_decode_attention
from gpurl.kernels.pallas_attention import flash_attention
from gpurl.kernels.pallas_paged import paged_decode_attention as paged_pallas
from gpurl.models import model_spec
from gpurl.models.gguf import load_gguf_params, model_config_from_gguf
from test_attention import Case, _paged_case, assert_close, reference, value_and_grads

def gpu_only(test):
    """The `gpu` tier: runs on a CUDA GPU, skipped elsewhere."""
    skip = pytest.mark.skipif(jax.default_backend() != "gpu",
                              reason="needs a CUDA GPU (the gpu tier; benchmarks/gpu.sh)")
    return pytest.mark.gpu(skip(test))

GPU_CASES = {
    "gqa-bf16-window-softcap": Case(b=2, t=256, s=256, h=8, k=2, d=64, dtype="bfloat16",
                                    window=96, softcap=30.0, packed=True),
    "mqa-bf16-d256": Case(b=1, t=192, s=192, h=4, k=1, d=256, dtype="bfloat16", packed=True),
    "prefill-into-cache-fp32": Case(b=2, t=64, s=160, h=4, k=2, d=64, window=80),
}


@gpu_only
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_triton_flash_attention_matches_reference(name):
    c = GPU_CASES[name]

    def compiled(*args, **kw):
        return flash_attention(*args, **kw, interpret=False)

    want, want_grads = value_and_grads(reference, c)
    got, got_grads = value_and_grads(compiled, c)
    assert_close(got, want, c.dtype, "output")
    for what, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
        assert_close(g, w, c.dtype, what)


@gpu_only
@pytest.mark.parametrize("window,softcap", [(None, None), (8, 5.0)])
def test_triton_paged_decode_matches_reference(window, softcap):
    q, k, v, table, lengths = _paged_case(2)
    kw = dict(scale=0.3, softcap=softcap, window=window)
    want = paged_decode_attention(q, k, v, jnp.int32(1), table, lengths, jnp.int32(3), **kw)
    got = jax.jit(lambda *a: paged_pallas(*a, **kw, interpret=False))(
        q, k, v, jnp.int32(1), table, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


@gpu_only
@pytest.mark.parametrize("sizes", [[50, 0, 97, 1, 60, 52], [0, 0, 300, 0, 0, 0]])
def test_triton_grouped_matmul_matches_ragged_dot(sizes):
    """The MoE grouped matmul's Pallas kernels compiled by Triton (`auto` on GPU) against
    `jax.lax.ragged_dot`, fp32: forward, input gradient, weight gradient."""
    from gpurl.kernels.grouped_matmul import grouped_matmul

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(300, 96)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 96, 80)), jnp.float32)
    sizes = jnp.asarray(sizes)

    def loss(impl, x, w):
        return (jnp.sin(grouped_matmul(x, w, sizes, impl)) ** 2).sum()
    for fn in (lambda impl, x, w: grouped_matmul(x, w, sizes, impl),
               lambda impl, x, w: jax.grad(lambda x, w: loss(impl, x, w), (0, 1))(x, w)):
        want = jax.jit(lambda x, w: fn("ragged", x, w))(x, w)
        got = jax.jit(lambda x, w: fn("pallas", x, w))(x, w)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-3)


@gpu_only
def test_real_model_bf16_logits_match_fp32(gemma3_gguf: Path):
    """Gemma 3 270M on 64 tokens of text: bf16 compute against fp32 (same weights)."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(np.concatenate([[[2]], rng.integers(100, 20000, (1, 63))], 1), jnp.int32)
    positions = jnp.arange(64, dtype=jnp.int32)[None]
    segments = jnp.ones((1, 64), jnp.int32)
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = model_config_from_gguf(gemma3_gguf, ModelConfig(dtype=dtype, attention="auto"))
        spec = model_spec(dataclasses.replace(cfg))
        mesh = trainer_mesh(MeshConfig(data=1), jax.devices()[:1])
        params = load_gguf_params(gemma3_gguf, spec, tree_shardings(
            spec.abstract_params, spec.logical_axes, MeshConfig().train_rules, mesh))
        out[dtype] = np.asarray(jax.jit(spec.apply)(params, tokens, positions, segments),
                                np.float32)
    f32, bf16 = out["float32"], out["bfloat16"]
    # bf16 keeps 8 mantissa bits: logits agree to a few percent of their spread, and the
    # next-token choice agrees almost everywhere
    spread = float(f32.std())
    assert float(np.abs(bf16 - f32).mean()) < 0.05 * spread
    assert float((bf16.argmax(-1) == f32.argmax(-1)).mean()) >= 0.9


@pytest.mark.e2e
def test_the_gpu_command_passes_its_cpu_smoke_form(tmp_path):
    """`benchmarks/gpu.sh --cpu-smoke`: every part of the GPU command at tiny sizes on CPU
    (the gpu tier collected and skipped, train-step MFU, decode on the rollout engine twice
    with the account's roofline, the GRPO step against its committed account, the main job's
    breakdown, the MoE grouped matmul), so the one command a lent GPU runs is known to work
    end to end before it gets one."""
    import json

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gpu"
    run = subprocess.run(["bash", str(root / "benchmarks" / "gpu.sh"), "--cpu-smoke", str(out)],
                         capture_output=True, text=True, timeout=900, cwd=root,
                         env={**os.environ, "PYTHON": sys.executable,
                              "XLA_FLAGS": xla_flags(4)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert not (out / "failed.txt").exists(), (out / "failed.txt").read_text()
    table = run.stdout[run.stdout.index("| measurement |"):]
    assert "not measured" not in table and "did not run" not in table, table
    for row in ("gpu test tier", "train step MFU", "decode tok/s, tiny-sized, B=8",
                "the compiler's account", "GRPO step, tiny-sized, 8 x 80 tokens: rollout",
                "GRPO step, tiny-sized, 8 x 80 tokens: prepare step",
                "GRPO step, tiny-sized, 8 x 80 tokens: RL tokens/s per GPU", "main job",
                "main job: rollout", "MoE grouped matmul, tiled"):
        assert row in table, table
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["rows"]) == table.count("\n| ") - 1 and not summary["failed"]
    assert set(summary["seconds"]) == {"gpu_tests", "train_step", "decode_gemma2b",
                                       "decode_qwen3_1_7b", "rl_step", "grpo_step", "moe_kernel"}
    # every row decoded in full (rollout.ignore_eos), the phases against a real account
    step = json.loads((out / "rl_step.json").read_text())
    assert step["completion_length"] == 16 and step["account"] == "benchmarks/accounts/rl_step_tiny.json"
    assert all(step["bound_s"][k] > 0 and step["measured_s"][k] > 0
               for k in ("rollout", "prepare step", "train step"))
    decode = json.loads((out / "decode_qwen3_1_7b.json").read_text())
    assert decode["decode_steps"] == 7 and decode["account_unit"].startswith("decode step (8 rows")

"""Every program a run compiles, lowered for CUDA on this CPU machine (CI has no GPU).

`gpurl.train.lowering.lower` builds the run with a GPU's choices (attention `auto` ->
cuDNN, Pallas kernels for Triton instead of the interpreter, bf16, the MoE grouped matmul
as Pallas kernels) and
lowers each program (train step, eval step, RL prepare, rollout prefill and decode chunk,
preference log-probs) with `lowering_platforms=("cuda",)` under a 2 x 2 mesh of this
machine's devices. A GPU-only path that stops lowering (a Pallas op without a Triton rule,
a cuDNN attention that cannot be traced, a kernel that no longer runs under the program's
shards) fails here. Also checked on CPU: the Pallas kernels under `shard_map` (each device
its own rows and heads) give the model's logits of the whole-batch xla path.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import TINY_MODEL, make_config
from gpurl.config import LoraConfig, MoEConfig
from gpurl.kernels import platform
from gpurl.models import model_spec
from gpurl.models.layers import sharded_rows
from gpurl.train.lowering import lower

pytestmark = pytest.mark.cuda_lowering

# bf16 (cuDNN's dtype) and head width 64 (cuDNN and the Triton dots take it)
MODEL = dict(TINY_MODEL, dtype="bfloat16", head_dim=64)
MESH = {"data": 2, "tp": 2}
RL = dict(data={"name": "arithmetic", "num_train": 16, "num_eval": 0, "max_len": 16},
          rollout={"max_new_tokens": 8}, train={"batch_size": 4, "eval_every": 0})
PREFS = dict(data={"name": "arithmetic_prefs", "num_train": 16, "num_eval": 0, "max_len": 16},
             train={"batch_size": 4})
MOE = dict(MODEL, family="qwen3_moe", activation="silu", norm_plus_one=False,
           scale_embeddings=False, qk_norm=True,
           moe=MoEConfig(num_experts=4, experts_per_token=2, expert_mlp_dim=16))

CUDNN = "CustomSPMDPartitioning"  # cuDNN attention's custom partitioning (batch and heads)
TRITON = "xla.gpu.triton"  # a Pallas kernel compiled by Triton
MANUAL = re.compile(r"sdy\.manual_computation|shard_map|Sharding.*manual|SPMDFullToShardShape")

# name -> (algo, model, other groups, the programs the run lowers)
RUNS = {
    "sft, auto (cuDNN)": ("sft", dict(MODEL, attention="auto"), {}, ["train step", "eval step"]),
    "sft with LoRA, pallas": ("sft", dict(MODEL, attention="pallas", lora=LoraConfig(rank=4)), {},
                              ["train step", "eval step"]),
    "grpo, auto": ("grpo", dict(MODEL, attention="auto"), RL,
                   ["train step", "prepare", "rollout prefill", "rollout decode chunk"]),
    "grpo, pallas": ("grpo", dict(MODEL, attention="pallas"), RL,
                     ["train step", "prepare", "rollout prefill", "rollout decode chunk"]),
    "ppo with critic, xla": ("ppo", dict(MODEL, attention="xla"), RL,
                             ["train step", "prepare", "rollout prefill", "rollout decode chunk"]),
    "dpo, auto": ("dpo", dict(MODEL, attention="auto"), PREFS, ["train step", "sequence log-probs"]),
    "rm, auto": ("rm", dict(MODEL, attention="auto"), PREFS, ["train step"]),
    "moe sft, auto (pallas grouped matmul)": ("sft", dict(MOE, attention="auto"), {},
                                              ["train step", "eval step"]),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_every_program_lowers_for_cuda(name, tmp_path):
    algo, model, groups, names = RUNS[name]
    groups = {k: dict(v) for k, v in groups.items()}
    groups.setdefault("train", {}).setdefault("batch_size", 4)
    cfg = make_config(algo={"name": algo}, model=model, mesh=MESH, run={"dir": str(tmp_path)},
                      logger={"progress": False}, **groups)
    lowered = {p.name: p for p in lower(cfg)}
    assert list(lowered) == names
    assert platform.backend() == "cpu"  # the GPU's choices end with the lowering
    train = lowered["train step"]
    if model["attention"] == "auto":
        assert train.count(CUDNN) >= 1, "auto on a GPU runs cuDNN attention"
    if model["attention"] == "pallas":
        assert train.count(TRITON) >= 2 and MANUAL.search(train.text), \
            "the Pallas kernels (forward, backward) run under shard_map"
    if model["attention"] == "xla":
        assert train.count(TRITON) == 0 and train.count(CUDNN) == 0
    if "rollout decode chunk" in lowered and model["attention"] != "xla":
        decode = lowered["rollout decode chunk"]  # paged Pallas decode (cuDNN has none)
        assert decode.count(TRITON) >= 1 and MANUAL.search(decode.text)
    if model.get("moe"):  # the experts' grouped matmul: forward, input and weight gradients
        assert "gpurl_grouped_mm" in train.text and "gpurl_grouped_tmm" in train.text
        assert "ragged_dot" not in train.text
    for program in lowered.values():
        assert "lowering_platforms" not in program.text and len(program.text) > 1000


def test_pallas_under_shard_map_equals_xla_on_a_mesh():
    """Interpreted on CPU: the kernels on each device's own rows and heads (2 x 2 mesh)
    give the logits and one decode step of the whole-batch xla attention."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tp"))
    rows = NamedSharding(mesh, P("data"))
    rules = {"batch": ["data"], "heads": ["tp"], "kv_heads": ["tp"]}
    model = dict(TINY_MODEL, sliding_window=4, global_every=2, attn_softcap=20.0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 259, (4, 10)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (4, 10))
    segments = jnp.asarray([[1] * 10, [1] * 7 + [0] * 3, [1] * 4 + [2] * 6, [1] * 10], jnp.int32)

    def logits(attention: str):
        spec = model_spec(dataclasses.replace(make_config(model=dict(model, attention=attention)).model))
        params = jax.jit(spec.init, static_argnums=0)(0)

        @jax.jit
        def forward(params, tokens, positions, segments):
            with sharded_rows(rows, rules):
                return spec.apply(params, tokens, positions, segments)

        args = [jax.device_put(x, rows) for x in (tokens, positions, segments)]
        return np.asarray(forward(params, *args))

    np.testing.assert_allclose(logits("pallas"), logits("xla"), atol=1e-4, rtol=1e-4)

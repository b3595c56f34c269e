"""The rollout's copy of the policy (issue 33): made at weight sync in the compute dtype,
its stacked layers held apart when the rollout runs them unrolled, and laid out on a
rollout mesh whose tensor-parallel width `mesh.rollout_tp=auto` picks. Greedy decoding
from the copy equals decoding from the stored parameters (fp32: exactly the same tokens),
and a LoRA run moves its frozen base once."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpurl.config import ConfigError, MeshConfig, ModelConfig, RolloutConfig
from gpurl.distributed import layout
from gpurl.distributed.mesh import rollout_mesh, trainer_mesh, tree_shardings
from gpurl.distributed.sync import WeightSync
from gpurl.models.spec import model_spec
from gpurl.rollout.engine import Engine

MODEL = dict(name="t", vocab_size=259, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
             head_dim=8, mlp_dim=64, family="qwen3", qk_norm=True)
TRAIN = MeshConfig(data=1, fsdp=4)


@functools.cache
def _engine(dtype: str, layers: str, tp: int = 2, lora: int = 0, split: bool = False
            ) -> tuple[Engine, object]:
    """An engine and the trainer's parameter layout: colocated (both on the 4 devices) or
    split (trainer on devices 0-1 with fsdp 2, rollout on 2-3)."""
    cfg = ModelConfig(**MODEL, dtype=dtype, sampling_layers=layers)
    if lora:
        cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=lora))
    spec = model_spec(cfg)
    mesh = MeshConfig(rollout_tp=str(tp))
    devices = jax.devices()
    engine = Engine(spec, RolloutConfig(max_new_tokens=6, temperature=0.0),
                    rollout_mesh(mesh, devices[2:] if split else devices), mesh.sample_rules,
                    stop_ids=(), pad_id=0)
    train = MeshConfig(data=1, fsdp=2) if split else TRAIN
    shardings = tree_shardings(spec.abstract_params, spec.logical_axes, train.train_rules,
                               trainer_mesh(train, devices[:2] if split else devices))
    return engine, shardings


def _params(engine: Engine, shardings: object) -> object:
    spec = engine.spec
    return jax.jit(lambda: jax.tree.map(lambda x: x + 0.05, spec.init(0)), out_shardings=shardings)()


def test_the_copy_is_in_the_compute_dtype_and_layers_apart_when_unrolled():
    engine, shardings = _engine("bfloat16", "unrolled")
    copy = WeightSync(shardings, engine.abstract_params)(_params(engine, shardings))
    q = copy["blocks"]["attn"]["q"]
    assert isinstance(q, tuple) and len(q) == 3  # one array per layer
    assert q[0].dtype == jnp.bfloat16 and q[0].shape == (32, 4, 8)
    assert q[0].sharding.spec == jax.sharding.PartitionSpec(None, "tp", None)  # heads over tp
    assert copy["embed"].dtype == jnp.bfloat16
    # norm scales are read in float32 by every forward: kept as stored
    assert all(s.dtype == jnp.float32 for s in copy["blocks"]["attn_norm"]["scale"])
    assert copy["final_norm"]["scale"].dtype == jnp.float32


@pytest.mark.parametrize("layers, split", [("scan", False), ("unrolled", False), ("unrolled", True)])
def test_greedy_tokens_from_the_copy_equal_those_from_the_stored_parameters(layers, split):
    scan, shardings = _engine("float32", "scan", tp=1, split=split)
    engine, _ = _engine("float32", layers, split=split)
    params = _params(engine, shardings)
    requests = [engine.request([1, 2, 3 + i, 7], seed=i) for i in range(2)]
    sync = WeightSync(shardings, engine.abstract_params)
    assert sync.colocated != split
    want = scan.generate(WeightSync(shardings, scan.abstract_params)(params), requests)
    copy = sync(params)  # split: gathered on the trainer's devices, moved layer by layer
    for got in [engine.generate(copy, requests)] + ([] if split else [engine.generate(params, requests)]):
        for a, b in zip(want, got):
            assert a.tokens.tolist() == b.tokens.tolist()
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_a_lora_base_is_cast_and_moved_once():
    engine, shardings = _engine("bfloat16", "unrolled", lora=4)
    sync = WeightSync(shardings, engine.abstract_params)
    params = _params(engine, shardings)
    first = sync(params)
    second = sync(params)
    base, adapter = first["blocks"]["attn"]["q"], first["blocks"]["attn"]["q_lora"]["a"]
    assert second["blocks"]["attn"]["q"][0] is base[0]  # the frozen base: moved once
    assert second["blocks"]["attn"]["q_lora"]["a"][0] is not adapter[0]  # adapters: every sync
    assert adapter[0].dtype == jnp.bfloat16


def test_auto_takes_the_narrowest_width_within_a_tenth_of_the_most_room():
    spec = model_spec(ModelConfig(**MODEL, dtype="bfloat16"))
    devices = jax.devices()
    assert layout.widths(4, spec.cfg) == [1, 2]  # 2 KV heads
    assert layout.widths(16, dataclasses.replace(spec.cfg, num_kv_heads=4)) == [1, 2, 4]
    full = layout.weight_bytes(spec, MeshConfig(), devices, 1)
    half = layout.weight_bytes(spec, MeshConfig(), devices, 2)
    assert half < full
    auto = MeshConfig()
    # plenty of room: the narrowest; room only for the KV pool at width 2: 2
    assert layout.resolve(auto, spec, devices, 100 * full)[0].rollout_width == 1
    resolved, line = layout.resolve(auto, spec, devices, full + 0.5 * (full - half))
    assert resolved.rollout_width == 2 and "mesh.rollout_tp=auto picked 2" in line
    # nothing fits: the most room
    assert layout.resolve(auto, spec, devices, 0.0)[0].rollout_width == 2
    assert layout.resolve(MeshConfig(rollout_tp="1"), spec, devices, 0.0)[0].rollout_width == 1


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_rollout_width_is_one_sentence(value):
    with pytest.raises(ConfigError, match=rf"^mesh.rollout_tp={value} is not valid; use a "
                                          rf"positive size or auto\.$"):
        MeshConfig(rollout_tp=value)

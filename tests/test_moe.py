"""Mixture-of-experts (Qwen3-MoE): logits equal transformers' on one device and with the
experts split over mesh axes, expert parallelism equals one device in loss and gradients,
the router terms equal transformers' load-balancing loss, the grouped matmul's two
implementations agree, the presets have the published sizes, and bad meshes are one
sentence."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch

import hf_models
from conftest import make_config
from gpurl.config import ConfigError, LoraConfig, MeshConfig, ModelConfig, MoEConfig
from gpurl.distributed.mesh import batch_sharding, trainer_mesh, tree_shardings
from gpurl.kernels.grouped_matmul import grouped_matmul
from gpurl.models import model_spec, moe
from gpurl.models.hf import load_hf_params, model_config_from_hf
from gpurl.models.layers import sharded_rows
from gpurl.data.batching import step_indices, take
from gpurl.data.sft import encode_sft
from gpurl.data.sources import load_examples
from gpurl.train import loop
from gpurl.algorithms import registry
from gpurl.models.loading import load_tokenizer
from gpurl.train.optim import make_optimizer
from gpurl.train.step import accumulate_grads, jit_rows, placement

RULES = MeshConfig().train_rules
B, T = 4, 10
TOKENS = np.random.default_rng(1).integers(0, hf_models.VOCAB, (B, T))
LENGTHS = np.array([10, 7, 10, 4])  # right padding: router terms count real tokens only
MASK = (np.arange(T)[None] < LENGTHS[:, None]).astype(np.int32)
# (data, fsdp, expert, tp) meshes of the 4 host devices with the experts split over 2
MESHES = [(1, 1, 1, 1), (1, 2, 2, 1), (2, 1, 2, 1), (1, 1, 2, 2), (1, 1, 4, 1)]


@functools.cache
def _checkpoint(kind: str, root: str) -> tuple[object, Path]:
    """A tiny random Qwen3MoeForCausalLM: `mixed` (layer 1 dense, per hf_models) or
    `sparse` (every layer sparse, top-k weights not renormalized)."""
    extra = {} if kind == "mixed" else {"mlp_only_layers": [], "norm_topk_prob": False}
    model = hf_models.build("qwen3_moe", **extra)
    path = Path(root) / kind
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe"))
    return lambda kind: _checkpoint(kind, root)


def _forward(path: Path, mesh_sizes: tuple[int, ...], lengths=None, **moe_fields):
    """(logits, compiled HLO text, router stats) of gpurl's forward with the params placed
    by the train rules on that mesh and the layout known to the model (as in a train
    step)."""
    data, fsdp, expert, tp = mesh_sizes
    cfg = model_config_from_hf(path, ModelConfig(dtype="float32"))
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe_fields))
    spec = model_spec(cfg)
    mesh = trainer_mesh(MeshConfig(data=data, fsdp=fsdp, expert=expert, tp=tp),
                        jax.devices()[:data * fsdp * expert * tp])
    params = load_hf_params(path, spec, tree_shardings(spec.abstract_params, spec.logical_axes,
                                                       RULES, mesh))
    rows = batch_sharding(mesh, RULES)

    def apply(params, tokens, segments):
        with sharded_rows(rows, RULES), moe.collect() as found:
            positions = jnp.broadcast_to(jnp.arange(T), tokens.shape)
            return spec.apply(params, tokens, positions, segments), found[0]

    segments = MASK if lengths is None else lengths
    args = (params, jax.device_put(jnp.asarray(TOKENS, jnp.int32), rows),
            jax.device_put(jnp.asarray(segments), rows))
    compiled = jax.jit(apply).lower(*args).compile()
    logits, stats = compiled(*args)
    return np.asarray(logits), compiled.as_text(), stats


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sparse", "mixed"])
def test_logits_equal_transformers_on_every_expert_layout(ckpt, kind):
    model, path = ckpt(kind)
    theirs = hf_models.logits(model, TOKENS, MASK)
    real = MASK.astype(bool)
    for sizes in MESHES:
        ours, hlo, _ = _forward(path, sizes)
        assert np.abs(ours[real] - theirs[real]).max() < 1e-5, sizes
        if sizes[2] > 1:  # tokens really travel to the experts' devices and back
            assert "all-gather" in hlo and "reduce-scatter" in hlo, sizes


@pytest.mark.slow
def test_capacity_drops_only_past_each_devices_share(ckpt):
    """Expert parallel over 4 devices with 8 experts: a device's buffer is the factor x
    its even share (a quarter) of its group's token copies. Factor 4 holds every copy (the
    dropless result exactly); factor 0.5 drops some, which change the output."""
    _, path = ckpt("sparse")
    dropless, _, _ = _forward(path, (1, 1, 4, 1))
    roomy, _, stats = _forward(path, (1, 1, 4, 1), capacity_factor=4.0)
    np.testing.assert_array_equal(roomy, dropless)
    assert float(np.asarray(stats.dropped).sum()) == 0.0
    tight, _, stats = _forward(path, (1, 1, 4, 1), capacity_factor=0.5)
    dropped = float(np.asarray(stats.dropped).sum())
    copies = float(np.asarray(stats.counts_O).sum())
    assert 0 < dropped < copies and np.abs(tight - dropless).max() > 1e-3


@pytest.mark.slow
def test_fused_expert_tensors_load_like_per_expert_ones(ckpt, tmp_path):
    """transformers 5 keeps experts fused in memory (experts.gate_up_proj E x 2F x D,
    experts.down_proj E x D x F); a checkpoint saved from that state dict loads the same."""
    model, path = ckpt("sparse")
    fused = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in fused)
    safetensors.torch.save_file(fused, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    a, _, _ = _forward(path, (1, 1, 1, 1))
    b, _, _ = _forward(tmp_path, (1, 1, 1, 1))
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_router_terms_equal_transformers_load_balancing_loss(ckpt):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model, path = ckpt("mixed")
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(TOKENS), attention_mask=torch.as_tensor(MASK),
                    output_router_logits=True)
    cfg = model.config
    theirs = float(load_balancing_loss_func(out.router_logits, cfg.num_experts,
                                            cfg.num_experts_per_tok, torch.as_tensor(MASK)))
    logits = np.stack([r.numpy() for r in out.router_logits]).reshape(2, B * T, -1)
    real = MASK.reshape(-1).astype(bool)
    lse = np.log(np.exp(logits).sum(-1))
    z = float((lse[:, real] ** 2).mean())

    spec = model_spec(model_config_from_hf(path, ModelConfig(dtype="float32")))
    params = load_hf_params(path, spec, jax.tree.map(
        lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), spec.abstract_params))
    with moe.collect() as found:
        spec.apply(params, jnp.asarray(TOKENS), jnp.broadcast_to(jnp.arange(T), (B, T)),
                   jnp.asarray(MASK))
    terms = moe.router_terms(found, cfg.num_experts, cfg.num_experts_per_tok)
    assert abs(float(terms["aux_loss"]) - theirs) < 1e-5 and theirs > 1.0
    assert abs(float(terms["z_loss"]) - z) < 1e-4
    counts = found[0].counts_O  # sparse layers x experts, real tokens' top-k copies
    assert counts.shape == (2, cfg.num_experts) and float(counts.sum()) == 2 * real.sum() * 2
    per_layer = np.asarray(counts)
    assert float(terms["load_max"]) == pytest.approx(
        (per_layer.max(1) / per_layer.mean(1)).max(), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [
    [50, 0, 97, 1, 60, 52],  # an empty group, a one-row group, rows past the groups
    [0, 0, 300, 0, 0, 0],  # one group holds every row
    [13, 71, 2, 0, 88, 126],  # random sizes, every row in a group
])
def test_grouped_matmul_tiled_and_pallas_equal_ragged_dot(sizes):
    """Forward, input gradient and weight gradient of the jnp tiles and of the Pallas
    kernels (Pallas's interpreter) against `jax.lax.ragged_dot` and NumPy."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(300, 24)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 24, 40)), jnp.float32)
    sizes = jnp.asarray(sizes)
    used = int(sizes.sum())
    ref = np.zeros((300, 40), np.float32)
    for g, (a, b) in enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))):
        ref[a:b] = np.asarray(x[a:b]) @ np.asarray(w[g])
    for impl in ("ragged", "tiled", "pallas"):
        out = grouped_matmul(x, w, sizes, impl)
        assert float(jnp.abs(out[used:]).max(initial=0.0)) == 0.0, impl
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4, err_msg=impl)

    def loss(impl, x, w):
        return (jnp.sin(grouped_matmul(x, w, sizes, impl)) ** 2).sum()
    ga = jax.grad(functools.partial(loss, "ragged"), (0, 1))(x, w)
    for impl in ("tiled", "pallas"):
        gb = jax.grad(functools.partial(loss, impl), (0, 1))(x, w)
        for name, a, b in zip(("dx", "dw"), ga, gb):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4, err_msg=f"{impl} {name}")


def _moe_sft_config(mesh: dict) -> object:
    model = {"family": "qwen3_moe", "vocab_size": 259, "d_model": 32, "num_layers": 2,
             "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "mlp_dim": 64,
             "activation": "silu", "norm_plus_one": False, "scale_embeddings": False,
             "qk_norm": True, "dtype": "float32", "tokenizer": "bytes",
             "moe": MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=16,
                              aux_loss_coef=0.01, z_loss_coef=0.001)}
    return make_config(model=model, mesh=mesh, data={"max_len": 24, "num_train": 64, "num_eval": 8},
                       train={"batch_size": 8, "micro_batch_size": 4, "eval_batch_size": 8})


@pytest.mark.slow
def test_expert_parallel_equals_one_device_in_loss_and_gradients():
    results = []
    for devices, mesh in ((1, {"data": 1}), (4, {"data": 1, "expert": 4})):
        cfg = _moe_sft_config(mesh)
        spec = model_spec(cfg.model)
        place = placement(spec, make_optimizer(cfg.optim, 1),
                          trainer_mesh(cfg.mesh, jax.devices()[:devices]), cfg.mesh.train_rules)
        objective = registry.get("sft").objective(cfg.algo, cfg.rollout)
        params = jax.jit(lambda: spec.init(0), out_shardings=place.state.params)()
        rows = encode_sft(load_examples(cfg.data)[0], load_tokenizer(cfg.model), cfg.data)
        batch = take(rows, step_indices(len(rows), 8, 0, seed=0))
        batch = {k: jax.device_put(v, place.batch) for k, v in batch.items()}
        grads, metrics = jit_rows(lambda p, b: accumulate_grads(
            spec, objective, place, 2, p, b), place)(params, batch)
        results.append((jax.device_get(grads), jax.device_get(metrics), params))
    (g1, m1, _), (g4, m4, p4) = results
    assert "expert" in str(p4["blocks"]["moe"]["gate"].sharding.spec)
    for key in ("loss", "moe/aux_loss", "moe/z_loss", "moe/load_max"):
        np.testing.assert_allclose(m1[key], m4[key], rtol=1e-5, err_msg=key)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g4)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
    assert float(np.abs(g1["blocks"]["moe"]["router"]).max()) > 0  # the router learns


def test_experts_that_do_not_split_over_the_mesh_are_one_sentence():
    cfg = _moe_sft_config({"data": 1, "expert": 4})
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, moe=dataclasses.replace(cfg.model.moe, num_experts=6)))
    with pytest.raises(ConfigError) as info:
        loop.build(cfg)
    message = str(info.value)
    assert message == ("model.moe.num_experts=6 does not split over the 4 devices of mesh "
                       "axes expert; choose mesh.expert dividing 6.")


def test_moe_config_is_read_back_from_its_export(ckpt, tmp_path):
    from gpurl.models.hf_export import hf_config_dict

    _, path = ckpt("mixed")
    cfg = model_config_from_hf(path, ModelConfig())
    assert (cfg.moe.num_experts, cfg.moe.experts_per_token, cfg.moe.dense_layers) == (8, 2, (1,))
    written = hf_config_dict(cfg)
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert model_config_from_hf(tmp_path, ModelConfig()) == cfg
    assert written["mlp_only_layers"] == [1] and written["num_experts"] == 8


@pytest.mark.slow
def test_routing_replay_records_the_samplers_experts_and_the_trainer_uses_them(ckpt):
    from gpurl.algorithms.forward import group_logprobs
    from gpurl.config import RolloutConfig
    from gpurl.distributed.mesh import rollout_mesh
    from gpurl.rollout.engine import Engine

    _, path = ckpt("sparse")
    cfg = model_config_from_hf(path, ModelConfig(dtype="float32"))
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, replay_routing=True))
    spec = model_spec(cfg)
    mesh = rollout_mesh(MeshConfig(rollout_tp=2))  # experts split over the rollout tp axis
    engine = Engine(spec, RolloutConfig(max_new_tokens=6, temperature=1.0, block_size=4,
                                        decode_chunk=3, slots=2), mesh,
                    MeshConfig().sample_rules, stop_ids=(), pad_id=0)
    params = load_hf_params(path, spec, engine.param_shardings)
    prompt = [5, 17, 99, 3]
    (c,) = engine.generate(params, [engine.request(prompt, seed=3)])
    routes = c.routes
    layers, k = 3, 2
    assert routes.shape == (6, layers, k) and routes.dtype == np.int16
    assert (routes[-1] == -1).all() and ((routes[:-1] >= 0) & (routes[:-1] < 8)).all()

    # the trainer, routing on its own, picks the experts the sampler recorded (fp32)
    seq = jnp.asarray([prompt + c.tokens.tolist()])
    with moe.chosen_experts() as chosen:
        spec.hidden(params, seq, jnp.arange(seq.shape[1])[None], jnp.ones_like(seq))
    own = np.sort(np.asarray(chosen[0])[:, 0, len(prompt):len(prompt) + 5], -1)  # L x 5 x k
    np.testing.assert_array_equal(own, np.sort(routes[:-1].transpose(1, 0, 2), -1))

    batch = {"prompt_tokens": jnp.asarray([prompt]), "prompt_lengths": jnp.asarray([4]),
             "completions": jnp.asarray(c.tokens)[None, None],
             "completion_lengths": jnp.asarray([[6]])}
    free = np.asarray(group_logprobs(spec, params, batch)[0])[0, 0]
    replayed = np.asarray(group_logprobs(spec, params, {**batch, "routes": jnp.asarray(routes)[None, None]})[0])[0, 0]
    np.testing.assert_allclose(replayed, c.logprobs, atol=1e-5)
    np.testing.assert_allclose(free, replayed, atol=1e-6)
    # other experts replayed: the log-probs of the tokens after the first move
    shifted = np.where(routes >= 0, (routes + 1) % 8, -1).astype(np.int16)
    moved = np.asarray(group_logprobs(spec, params, {**batch, "routes": jnp.asarray(shifted)[None, None]})[0])[0, 0]
    assert moved[0] == pytest.approx(replayed[0], abs=1e-6)  # predicted from the prompt alone
    assert np.abs(moved[1:] - replayed[1:]).min() > 1e-3


TINY_MOE = {"family": "qwen3_moe", "vocab_size": 259, "d_model": 32, "num_layers": 2,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "mlp_dim": 64, "activation": "silu",
            "norm_plus_one": False, "scale_embeddings": False, "qk_norm": True,
            "dtype": "float32", "tokenizer": "bytes",
            "moe": MoEConfig(num_experts=4, experts_per_token=2, expert_mlp_dim=16)}
ALGOS = {  # algo fields, data
    "sft": ({}, {"name": "arithmetic"}),
    "dpo": ({"beta": 0.1}, {"name": "arithmetic_prefs"}),
    "rm": ({}, {"name": "arithmetic_prefs"}),
    "grpo": ({"num_generations": 4}, {"name": "arithmetic"}),
    "ppo": ({"num_generations": 4, "critic_lr": 1e-2}, {"name": "arithmetic"}),
}


@pytest.mark.e2e
# plain GRPO on the MoE model: test_grpo.py's reward-rise run; SFT's loss and gradients:
# test_expert_parallel_equals_one_device_in_loss_and_gradients (its loop: GRPO's)
@pytest.mark.parametrize("name, lora", [(n, False) for n in ALGOS if n not in ("grpo", "sft")]
                         + [("grpo", True)])
def test_every_algorithm_and_lora_train_the_moe_model_expert_parallel(tmp_path, name, lora):
    algo, data = ALGOS[name]
    model = dict(TINY_MOE, lora=LoraConfig(rank=4)) if lora else TINY_MOE
    cfg = make_config(
        algo={"name": name, **algo}, model=model, mesh={"data": 2, "expert": 2},
        data={**data, "num_train": 32, "num_eval": 0, "max_len": 16},
        optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant"},
        train={"steps": 2, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0,
               "eval_batch_size": 4, "eval_pass_k": 0},
        rollout={"max_new_tokens": 6, "temperature": 1.0}, logger={"progress": False},
        run={"dir": str(tmp_path / "run")}, rewards=["test_grpo:printable"])
    summary = loop.train(cfg)
    assert summary["finished"] and summary["step"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert np.isfinite(last["loss"]) and last["grad_norm"] > 0, last
    assert 1.0 <= last["moe/load_max"] <= 2.0  # at most 4 experts / 2 per token
    written = (tmp_path / "run" / "config.yaml").read_text()
    # load balancing off by default outside SFT (registry: router_aux_loss)
    assert "aux_loss_coef: 0.0" in written


def test_load_balancing_defaults_follow_the_algorithm():
    """null model.moe.aux_loss_coef: 0.001 for SFT, 0 for RL and preference learning; a
    value set is kept; a dense model gets 0."""
    cfg = _moe_sft_config({"data": 1}).model
    unset = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, aux_loss_coef=None))
    coef = {name: loop._router_defaults(unset, registry.get(name)).moe.aux_loss_coef
            for name in ("sft", "grpo", "ppo", "dpo", "rm")}
    assert coef == {"sft": 0.001, "grpo": 0.0, "ppo": 0.0, "dpo": 0.0, "rm": 0.0}
    assert loop._router_defaults(cfg, registry.get("grpo")).moe.aux_loss_coef == 0.01
    dense = dataclasses.replace(unset, moe=dataclasses.replace(unset.moe, num_experts=0))
    assert loop._router_defaults(dense, registry.get("sft")).moe.aux_loss_coef == 0.0


@functools.cache
def _moe_grpo_step(matmul: str):
    """A GRPO step of the tiny Qwen3-MoE model, expert parallel over expert=2 x tp=2 with
    capacity 2 and routing replay, its experts' matmuls by `matmul`: (prepared batch,
    metrics, gradients, step metrics)."""
    from test_packing import CASES, _collected, _config, _grads, _prepared

    model = CASES["moe"]["model"]
    model = dict(model, moe=dataclasses.replace(model["moe"], grouped_matmul=matmul,
                                                capacity_factor=2.0))
    cfg = _config("grpo", model=model, mesh={"data": 1, "expert": 2, "tp": 2}, algo={"beta": 0.04})
    _, setup, stepper = loop.build(cfg)
    params = setup.init().params
    collected, rewards = _collected(stepper, multi_turn=False)
    batch, metrics, m = _prepared(stepper, params, collected, rewards, packed=True)
    grads, step_metrics = _grads(setup, batch, m)
    return jax.device_get((batch, metrics, grads, step_metrics))


@pytest.mark.slow
def test_grpo_step_with_the_pallas_grouped_matmul_equals_the_tiled_one():
    """The Pallas kernels (in Pallas's interpreter) give the jnp tiles' GRPO step: the
    prepared log-probs, every metric (router terms and dropped copies included) and every
    gradient, fp32 within 1e-5."""
    tiled, pallas = _moe_grpo_step("tiled"), _moe_grpo_step("pallas")
    for part in (1, 3):
        assert set(tiled[part]) == set(pallas[part])
        for k in tiled[part]:
            np.testing.assert_allclose(pallas[part][k], tiled[part][k], rtol=1e-5, atol=1e-5, err_msg=k)
    assert "ref_logprobs" in tiled[0]
    for k in tiled[0]:
        np.testing.assert_allclose(pallas[0][k], tiled[0][k], rtol=1e-5, atol=1e-5, err_msg=k)
    leaves = jax.tree_util.tree_leaves_with_path(tiled[2])
    assert any("moe" in jax.tree_util.keystr(p) for p, _ in leaves)
    for (path, a), b in zip(leaves, jax.tree.leaves(pallas[2])):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    assert float(np.abs(pallas[2]["blocks"]["moe"]["gate"]).max()) > 0  # the experts learn


def test_the_pallas_grouped_matmul_refuses_operands_past_32_bit_offsets():
    from gpurl.kernels import pallas_grouped
    from gpurl.kernels.grouped_matmul import tile_layout

    rows, d = 2**21, 1024
    layout = jax.eval_shape(lambda s: tile_layout(rows, s, 16), jax.ShapeDtypeStruct((8,), jnp.int32))
    layout = layout._replace(tile=16, tiles=rows // 16)
    with pytest.raises(ConfigError) as info:
        jax.eval_shape(lambda x, w: pallas_grouped.tiled_matmul(x, w, layout),
                       jax.ShapeDtypeStruct((rows, d), jnp.bfloat16),
                       jax.ShapeDtypeStruct((8, d, 64), jnp.bfloat16))
    assert str(info.value) == (
        "the Pallas grouped matmul addresses its operands with 32-bit offsets, and 2,097,152 "
        "token copies x 1024 or 8 experts x 1024 x 64 do not fit them; use smaller "
        "micro-batches (train.micro_batch_tokens) or model.moe.grouped_matmul=ragged.")
    assert isinstance(info.value, pallas_grouped.OffsetLimitError)
    fitting = rows * info.value.scale  # the rows that fit: just below the limit
    assert fitting * (d + 16) < 2**31 <= (fitting + 2) * (d + 16)


def test_the_automatic_budget_shrinks_below_a_kernels_limit():
    """train.micro_batch_tokens=0: a train step whose call the Pallas grouped matmul cannot
    address is planned again at the budget the kernel's error names (issue 66: MoE at 32K
    planned by default), said in the plan; an error no budget cures stays an error."""
    from types import SimpleNamespace

    from gpurl.kernels.pallas_grouped import OffsetLimitError
    from gpurl.train.fitting import _within_kernel_limits

    stepper = SimpleNamespace(budget=262_656)
    seen = []

    def train_plan():
        seen.append(stepper.budget)
        if stepper.budget * 16 * 2064 >= 2**31:  # 16 token copies of width 2048 (+16)
            raise OffsetLimitError("too large", (2**31 - 1) // 2064 / (stepper.budget * 16))
        return SimpleNamespace(chosen=[])

    plan = _within_kernel_limits(stepper, train_plan)
    assert seen[0] == 262_656 and len(seen) == 2 and 60_000 < stepper.budget < 65_000
    assert plan.chosen and "262,656 exceeded the Pallas grouped matmul's 32-bit offsets" in plan.chosen[0]

    def weights_too_large():
        raise OffsetLimitError("the experts alone", None)

    with pytest.raises(OffsetLimitError, match="the experts alone"):
        _within_kernel_limits(SimpleNamespace(budget=100), weights_too_large)

    def one_row_too_many():
        raise OffsetLimitError("too large", 0.9, 1_116_160)

    with pytest.raises(ConfigError, match=r"even one row per micro-batch .* \(1,116,160 of at "
                                          r"most 1,004,544\); split each row over devices with "
                                          r"mesh.context=2 or more, or set model.moe.grouped_matmul=ragged."):
        _within_kernel_limits(SimpleNamespace(budget=1), one_row_too_many)

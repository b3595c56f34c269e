"""LoRA: a fresh adapter is the base model exactly; only adapters are trained, stored in the
optimizer and checkpointed; the reference is the frozen base; merged and PEFT exports give
the adapted model's logits through transformers and peft; 2 processes (split placement,
adapter-only weight sync) train like 1."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.config import ConfigError, LoraConfig, ModelConfig
from gpurl.models import lora, model_spec
from gpurl.commands.export import export_run
from gpurl.train.restore import restore_run
from gpurl.train.loop import train

LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.1)


def _tokens(t: int = 12):
    tokens = (jnp.arange(t, dtype=jnp.int32)[None] * 7 + 3) % 259
    return tokens, jnp.arange(t)[None], jnp.ones((1, t), jnp.int32)


@pytest.mark.slow
def test_fresh_adapters_leave_the_base_model_exactly_and_targets_select_by_path():
    cfg = ModelConfig(**TINY_MODEL, lora=LORA)
    spec, base = model_spec(cfg), model_spec(lora.base_config(cfg))
    params = jax.jit(lambda: spec.init(0))()  # one compile, not one per eager op
    # attach() runs after the base is built: the base init is the one without LoRA
    base_init = jax.jit(lambda: base.init(0))()
    for a, b in zip(jax.tree.leaves(lora.strip(params)), jax.tree.leaves(base_init)):
        np.testing.assert_array_equal(a, b)
    ours = jax.jit(spec.apply)(params, *_tokens())
    theirs = jax.jit(base.apply)(lora.strip(params), *_tokens())
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))  # B = 0: exactly

    globs_and_regexes = dataclasses.replace(LORA, targets=("blocks/1/attn/*", r"mlp/down$"))
    assert lora.target_paths(dataclasses.replace(cfg, lora=globs_and_regexes)) == [
        "blocks/0/mlp/down", "blocks/1/attn/q", "blocks/1/attn/k", "blocks/1/attn/v",
        "blocks/1/attn/o", "blocks/1/mlp/down"]
    with pytest.raises(ConfigError, match="'embed' matches no projection"):
        lora.target_paths(dataclasses.replace(cfg, lora=dataclasses.replace(LORA, targets=("embed",))))
    frozen = lora.frozen_base({"policy": params, "critic": {"score": 0.0}})
    assert frozen["policy"]["blocks"]["attn"]["q"] and frozen["policy"]["embed"]
    assert not frozen["policy"]["blocks"]["attn"]["q_lora"]["b"] and not frozen["critic"]["score"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("lora_sft")
    cfg = make_config(model=dict(TINY_MODEL, tokenizer="bytes", lora=LORA),
                      logger={"progress": False},
                      data={"max_len": 24, "num_train": 64, "num_eval": 0},
                      optim={"lr": 3e-2, "warmup_steps": 0, "decay": "constant"},
                      train={"steps": 10, "batch_size": 8, "checkpoint_every": 5},
                      run={"dir": str(run)})
    train(cfg)
    # restore_run rebuilds the base from its seed (it is not in the checkpoint)
    _, params = restore_run(run)
    return run, cfg, params


@pytest.mark.e2e
def test_lora_sft_learns_and_checkpoints_only_adapters(sft_run):
    import orbax.checkpoint as ocp

    run, cfg, restored = sft_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5, losses

    spec = model_spec(cfg.model)
    adapter_sizes = sorted(int(np.prod(x.shape)) for p, x in
                           jax.tree_util.tree_flatten_with_path(spec.abstract_params)[0]
                           if lora.SUFFIX + "/" in lora.param_path(p))
    # an A and a B per projection, each stacked over the layers
    assert len(adapter_sizes) == 2 * 7 and all(s % cfg.model.num_layers == 0 for s in adapter_sizes)
    meta = ocp.StandardCheckpointer().metadata(run / "checkpoints" / "10" / "state")
    arrays = {k: v.shape for k, v in (getattr(meta, "item_metadata", None) or meta).items()
              if len(v.shape)}
    params = {k: s for k, s in arrays.items() if k.startswith("params.")}
    moments = {k: s for k, s in arrays.items() if k.startswith("opt_state.")}
    assert all("_lora." in k for k in params) and len(params) == len(adapter_sizes)
    # Adam's mu and nu, for the adapters alone
    assert sorted(int(np.prod(s)) for s in moments.values()) == sorted(adapter_sizes * 2)

    assert lora.has_adapters(restored)
    b = restored["blocks"]["mlp"]["down_lora"]["b"]
    assert float(jnp.abs(b).max()) > 0  # trained away from zero


@pytest.mark.e2e
def test_merged_and_peft_exports_give_the_adapted_logits(sft_run, tmp_path):
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    from gpurl.models.export import export_language_model
    from gpurl.models.hf_export import export_hf

    run, cfg, params = sft_run
    spec = model_spec(cfg.model)
    tokens, positions, segments = _tokens()
    ours = np.asarray(jax.jit(spec.apply)(params, tokens, positions, segments))
    base_logits = np.asarray(jax.jit(model_spec(lora.base_config(cfg.model)).apply)(
        lora.strip(params), tokens, positions, segments))
    assert np.abs(ours - base_logits).max() > 1e-3  # the adapters matter

    merged = export_run(run, tmp_path / "merged")  # the whole path once, then its last part
    adapter = export_language_model(spec, params, cfg.model, tmp_path / "adapter", adapter=True)
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    base_dir = export_hf(lora.strip(params), lora.base_config(cfg.model), tmp_path / "base")

    ids = torch.tensor(np.asarray(tokens), dtype=torch.long)
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        theirs = load(merged, torch_dtype=torch.float32)(ids).logits.numpy()
        with_peft = peft.PeftModel.from_pretrained(load(base_dir, torch_dtype=torch.float32), adapter)
        peft_logits = with_peft(ids).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    np.testing.assert_allclose(peft_logits, ours, atol=1e-4)


def test_lora_export_errors_are_one_sentence(tmp_path):
    from gpurl.models.export import export_language_model

    cfg = make_config(model=TINY_MODEL)
    with pytest.raises(ConfigError, match="model.lora.rank=0"):
        export_language_model(model_spec(cfg.model), {}, cfg.model, tmp_path, adapter=True)


# GRPO with a KL term (reference = the frozen base) on the tiny model with LoRA.
GRPO_LORA_ARGS = [
    "algo=grpo", "model=tiny", "model.tokenizer=bytes", "model.lora.rank=4", "model.lora.alpha=8",
    "data=arithmetic", "data.num_train=64", "data.num_eval=0", "data.max_len=16", "optim=adamw",
    "optim.lr=1e-2", "optim.warmup_steps=0", "optim.decay=constant", "train=default",
    "train.steps=3", "train.batch_size=4", "train.eval_every=0", "train.checkpoint_every=0",
    "train.eval_batch_size=16", "train.eval_pass_k=0", "rollout=default",
    "rollout.max_new_tokens=8", "algo.num_generations=4", "algo.beta=0.04",
    "rewards=[rl_rewards:printable_counted]", "logger.progress=false"]


@pytest.mark.multiprocess
def test_lora_grpo_two_processes_split_match_one_process(tmp_path):
    """2 processes x 2 devices with split placement (adapter-only weight sync after the
    first step) give 1 process's rewards, KL and losses; the KL of the first step is 0
    because the reference is the base and fresh adapters are zero."""
    from test_multiprocess import _launch

    runs = {"one": (1, []), "split": (2, ["mesh.placement=split", "mesh.rollout_devices=2"])}
    procs = []
    for name, (n, extra_args) in runs.items():
        procs += _launch(tmp_path / name, n, GRPO_LORA_ARGS + extra_args)
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    metrics = {name: [json.loads(line) for line in
                      (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in runs}
    one = [r for r in metrics["one"] if "loss" in r]
    assert len(one) == 3 and one[0]["kl"] == 0.0 and one[-1]["kl"] > 0
    assert [r["step"] for r in metrics["split"]] == [r["step"] for r in metrics["one"]]
    for a, b in zip(metrics["one"], metrics["split"]):
        for key in ("reward/mean", "loss", "kl", "grad_norm"):
            if key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.slow
def test_adapters_of_untargeted_layers_change_nothing_and_get_no_gradient():
    """Layers are stacked, so layer 0 carries an attn/q adapter when only layer 1's is
    targeted; its term is zeroed: setting its B changes no logit, and it gets no gradient."""
    cfg = ModelConfig(**TINY_MODEL, lora=dataclasses.replace(LORA, targets=("blocks/1/attn/q",)))
    spec = model_spec(cfg)
    params = jax.jit(lambda: spec.init(0))()
    adapter = params["blocks"]["attn"]["q_lora"]
    assert not np.asarray(adapter["a"][0]).any() and np.asarray(adapter["a"][1]).any()
    tokens = _tokens()
    before = jax.jit(spec.apply)(params, *tokens)
    b = adapter["b"].at[0].set(1.0)
    moved = dict(params, blocks=dict(params["blocks"], attn=dict(
        params["blocks"]["attn"], q_lora={"a": adapter["a"].at[0].set(1.0), "b": b})))
    np.testing.assert_array_equal(np.asarray(jax.jit(spec.apply)(moved, *tokens)),
                                  np.asarray(before))
    grads = jax.grad(lambda p: jax.jit(spec.apply)(p, *tokens).sum())(moved)
    g = grads["blocks"]["attn"]["q_lora"]
    assert not np.asarray(g["a"][0]).any() and not np.asarray(g["b"][0]).any()
    assert np.asarray(g["b"][1]).any()

"""The training loop: SFT learns, gradient accumulation and sharding do not change the
math, and the jitted step keeps its shardings."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.algorithms import registry
from gpurl.data.batching import step_indices, take
from gpurl.data.sft import encode_sft
from gpurl.data.sources import load_examples
from gpurl.distributed.mesh import trainer_mesh
from gpurl.models import model_spec
from gpurl.models.loading import load_tokenizer
from gpurl.train.loop import train
from gpurl.train.optim import make_optimizer
from gpurl.train.step import accumulate_grads, make_init, make_train_step, placement

CFG = make_config(model=TINY_MODEL, data={"max_len": 24, "num_train": 64, "num_eval": 8},
                  optim={"lr": 3e-3, "warmup_steps": 2})


def _pieces(cfg, devices):
    mesh = trainer_mesh(cfg.mesh, devices)
    spec = model_spec(cfg.model)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    place = placement(spec, optimizer, mesh, cfg.mesh.train_rules)
    return spec, registry.get(cfg.algo.name).objective(cfg.algo, cfg.rollout), optimizer, place


@functools.cache
def _rows():
    return encode_sft(load_examples(CFG.data)[0], load_tokenizer(CFG.model), CFG.data)


def _batch(place, size: int, step: int = 0):
    batch = take(_rows(), step_indices(len(_rows()), size, step, seed=0))
    return {k: jax.device_put(v, place.batch) for k, v in batch.items()}


@pytest.mark.slow
@pytest.mark.parametrize("devices,batch,micro", [(1, 4, 1), (4, 16, 4)])
def test_grad_accumulation_equals_one_big_batch(devices, batch, micro):
    spec, objective, optimizer, place = _pieces(CFG, jax.devices()[:devices])
    params = make_init(spec, optimizer, place, seed=0)().params
    data = _batch(place, batch)
    many = jax.jit(functools.partial(accumulate_grads, spec, objective, place, batch // micro))
    one = jax.jit(functools.partial(accumulate_grads, spec, objective, place, 1))
    (g_many, m_many), (g_one, m_one) = many(params, data), one(params, data)
    np.testing.assert_allclose(m_many["loss"], m_one["loss"], rtol=1e-6)
    assert m_many["tokens"] == m_one["tokens"] > 0
    for a, b in zip(jax.tree.leaves(g_many), jax.tree.leaves(g_one)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(g_one)) > 1e-3  # not vacuous


@pytest.mark.slow
def test_fsdp_sharded_equals_unsharded():
    results = []
    for devices, fsdp in ((jax.devices()[:1], 1), (jax.devices()[:4], 4)):
        cfg = make_config(model=TINY_MODEL, optim={"lr": 3e-3, "warmup_steps": 0},
                          mesh={"data": 1, "fsdp": fsdp}, train={"steps": 3})
        spec, objective, optimizer, place = _pieces(cfg, devices)
        state = make_init(spec, optimizer, place, seed=0)()
        step = make_train_step(spec, objective, optimizer, place, num_micro=2)
        losses = []
        for i in range(3):
            state, metrics = step(state, _batch(place, 8, i), None)
            losses.append(float(metrics["loss"]))
        results.append((jax.device_get(state.params), losses, state))
    (p1, l1, _), (p4, l4, s4) = results
    assert "fsdp" in str(s4.params["embed"].sharding.spec)  # really sharded over 4 devices
    assert len(s4.params["blocks"]["mlp"]["gate"].addressable_shards) == 4
    np.testing.assert_allclose(l1, l4, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.e2e
def test_sft_memorizes_small_set(tmp_path):
    cfg = make_config(model=TINY_MODEL, data={"max_len": 16, "num_train": 16, "num_eval": 0},
                      optim={"lr": 1e-2, "warmup_steps": 5}, logger={"progress": False},
                      train={"steps": 150, "batch_size": 16, "checkpoint_every": 100,
                             "eval_every": 0},
                      run={"dir": str(tmp_path / "run")})
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 150
    assert losses[0] > 3.0  # starts near chance (ln 259 = 5.6)
    assert losses[-1] < 0.05, losses[-10:]  # the 16 completions are memorized
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["100", "150"]


@pytest.mark.e2e
def test_eval_summary_packing_and_wandb_offline(tmp_path):
    cfg = make_config(model=TINY_MODEL,
                      data={"max_len": 24, "num_train": 64, "num_eval": 20, "packing": True},
                      logger={"name": "wandb", "mode": "offline"},
                      train={"steps": 4, "batch_size": 8, "eval_every": 2, "eval_batch_size": 8,
                             "checkpoint_every": 0, "keep_checkpoints": 1},
                      run={"dir": str(tmp_path / "run")})
    summary = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 4]
    assert summary["finished"] and summary["step"] == 4
    assert 0 < summary["eval/loss"] < 10 and summary["eval/perplexity"] > 1
    assert json.loads((tmp_path / "run/summary.json").read_text()) == summary
    assert [p.name for p in (tmp_path / "run/checkpoints").iterdir()] == ["4"]
    offline = list((tmp_path / "run/wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))  # the run was recorded


@pytest.mark.e2e
def test_save_final_false_with_checkpoint_every_0_saves_no_checkpoint(tmp_path):
    """train.save_final=false (benchmarks, throwaway sweeps): no checkpoint at the end, and
    with train.checkpoint_every=0 none at all; the run's metrics and summary are written."""
    cfg = make_config(model=TINY_MODEL, data={"max_len": 24, "num_train": 16, "num_eval": 0},
                      train={"steps": 2, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0,
                             "save_final": False},
                      run={"dir": str(tmp_path / "run")})
    summary = train(cfg)
    assert summary["finished"] and summary["step"] == 2
    assert not list((tmp_path / "run").glob("checkpoints/*"))
    assert len((tmp_path / "run/metrics.jsonl").read_text().splitlines()) >= 2

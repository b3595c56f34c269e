"""GRPO end to end on the tiny model: the loop, sharded rewards, and real learning."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from conftest import TINY_MODEL, make_config, with_rewards
from test_moe import TINY_MOE
from gpurl.commands.evaluate import evaluate
from gpurl.config import EvalConfig
from gpurl.train.loop import train

pytestmark = pytest.mark.e2e


def printable(prompts, completions, **_):
    """Share of a completion's characters that are printable ASCII: easy to learn for a
    random byte-level model (about 95 of its 259 tokens)."""
    return [sum(32 <= ord(c) < 127 for c in text) / max(len(text), 1) for text in completions]


def grpo_config(tmp_path, name: str, steps: int, run: str | None = None, model=None,
                mesh=None, **algo):
    return make_config(
        algo={"name": name, "num_generations": 4, **algo},
        model=model or dict(TINY_MODEL, tokenizer="bytes"), mesh=mesh or {},
        data={"name": "arithmetic", "num_train": 64, "num_eval": 8, "max_len": 16},
        optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant"},
        train={"steps": steps, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0,
               "eval_batch_size": 16, "eval_pass_k": 2},
        rollout={"max_new_tokens": 8, "temperature": 1.0},
        logger={"progress": False}, run={"dir": str(tmp_path / (run or name))},
        rewards=["test_grpo:printable"])


# the sampler/trainer mismatch, in every RL step's metrics (`gpurl.algorithms.behaviour`)
MISMATCH = ("mismatch/logprob_abs_mean", "mismatch/logprob_abs_max", "mismatch/k3_kl",
            "mismatch/over_threshold")


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["grpo", "gspo", "grpo_moe"])
def test_mean_reward_rises(tmp_path, name):
    """grpo_moe: the tiny mixture-of-experts model, experts split over 2 devices, routing
    replay on (every train forward routes completion tokens as the sampler did)."""
    moe = {}
    if name == "grpo_moe":
        model = dict(TINY_MOE, moe=dataclasses.replace(TINY_MOE["moe"], replay_routing=True))
        moe = {"model": model, "mesh": {"data": 2, "expert": 2}}
    cfg = grpo_config(tmp_path, name.removesuffix("_moe"), steps=30, run=name, **moe)
    summary = train(cfg)
    rows = [r for r in read_metrics(tmp_path / name) if "reward/mean" in r]
    if name == "grpo_moe":  # replayed routes reached the train step (fp32: no flips)
        assert all(r["moe/replay_flips"] < 0.05 for r in rows) and "moe/aux_loss" in rows[-1]
    rewards = np.asarray([r["reward/mean"] for r in rows])
    assert len(rewards) == 30
    first, last = rewards[:5].mean(), rewards[-5:].mean()
    assert last > first + 0.25, (first, last)
    assert {"eval/accuracy", "eval/pass@2", "eval/pass@1"} <= summary.keys()
    # sampled accuracy on held-out prompts rises too (greedy output is printable already)
    # (the MoE model's reward climbs later: 0.37 -> 0.76, pass@1 0 -> 0.25 in 30 steps)
    assert summary["eval/pass@1"] > summary["start"]["eval/pass@1"] + (0.2 if "moe" in name else 0.3)
    for key in ("loss", "grad_norm", "time/rollout_s", "time/reward_s", "time/train_s",
                "time/prepare_s", "completion/length", "groups/all_equal", *MISMATCH):
        assert key in rows[-1]
    # the prepare step is a part of the train phase: its outputs are ready before the step's
    assert all(0 < r["time/prepare_s"] <= r["time/train_s"] + 1e-3 for r in rows)
    if name != "grpo_moe":  # one model, fp32: sampler and trainer agree to float rounding
        assert max(r["mismatch/logprob_abs_max"] for r in rows) < 1e-3
    if name == "grpo":
        # `gpurl eval` on the run's checkpoint reproduces the loop's final eval exactly.
        figures = evaluate(EvalConfig(checkpoint=str(tmp_path / name), data=cfg.data,
                                      rollout=cfg.rollout, rewards=cfg.rewards, pass_k=2,
                                      batch_size=cfg.train.eval_batch_size, seed=cfg.train.seed))
        assert figures == {k: v for k, v in summary.items() if k.startswith("eval/")}


def constant_on_addition(prompts, completions, **_):
    """1.0 for every completion of an addition prompt (groups with no signal), else the
    printable share."""
    scores = printable(prompts, completions)
    return [1.0 if "+" in p else s for p, s in zip(prompts, scores)]


def test_dynamic_sampling_refills_the_batch(tmp_path):
    import dataclasses

    cfg = grpo_config(tmp_path, "dapo", steps=3, dynamic_sampling=True, max_refills=4,
                      epsilon_high=0.28, loss_agg="token_mean")
    cfg = dataclasses.replace(with_rewards(cfg, "test_grpo:constant_on_addition"),
                              train=dataclasses.replace(cfg.train, eval_pass_k=0))
    train(cfg)
    rows = [r for r in read_metrics(tmp_path / "dapo") if "reward/mean" in r]
    assert len(rows) == 3
    for row in rows:
        assert row["groups/kept"] == 4  # refilled to the full batch of prompts
        if row["groups/all_equal"] > 0:
            assert row["rollout/rounds"] > 1
    assert any(r["groups/all_equal"] > 0 for r in rows)
    # The trained batch holds only groups with a reward spread: its mean is below 1.
    assert all(r["reward/batch_mean"] < 1.0 for r in rows)


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    """Prompts, sampling seeds and the reference are functions of the step and the config:
    stopping after 2 steps and resuming gives the same rewards, losses and parameters."""
    import dataclasses

    import jax

    from gpurl.train.restore import restore_run

    def cfg_for(name, steps):
        cfg = grpo_config(tmp_path, "grpo", steps=steps, run=name, beta=0.04)
        return dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, checkpoint_every=2, eval_pass_k=0, steps=steps))

    train(cfg_for("straight", 4))
    train(cfg_for("resumed", 2))
    train(cfg_for("resumed", 4))
    keys = ("reward/mean", "loss", "kl", "grad_norm")
    straight = [{k: r[k] for k in keys} for r in read_metrics(tmp_path / "straight") if "loss" in r]
    resumed = [{k: r[k] for k in keys} for r in read_metrics(tmp_path / "resumed") if "loss" in r]
    assert len(straight) == 4 and straight == resumed
    (_, a), (_, b) = restore_run(tmp_path / "straight"), restore_run(tmp_path / "resumed")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def broken(prompts, completions, **_):
    return [1.0 / (len(c) - len(c)) for c in completions]


def test_a_raising_reward_stops_the_run_with_its_name_and_row(tmp_path):
    import dataclasses

    from gpurl.rewards import RewardError

    cfg = grpo_config(tmp_path, "grpo", steps=2)
    cfg = dataclasses.replace(with_rewards(cfg, "test_grpo:broken"),
                              train=dataclasses.replace(cfg.train, eval_pass_k=0))
    with pytest.raises(RewardError, match=r"reward function 'test_grpo:broken' raised "
                                          r"ZeroDivisionError: .* on row \d+; fix the function"):
        train(cfg)

"""The RL step trains on what its configuration says: each test here pins one place where a
run once trained on something else without an error or a visible metric (a reward model
routed by the policy's experts, an environment's reward dropped beside a reward model, a
KL penalty measured from the sampler, a data stream that skipped prompts under dynamic
sampling, rollouts sampled a step ahead trained as if on-policy)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, algo_config, make_config
from gpurl.config import MoEConfig

P, G, N, W = 2, 3, 4, 8
CLEN = np.asarray([[4, 2, 1], [3, 4, 2]])


def _batch(rng: np.random.Generator) -> dict:
    """A grouped RL batch of P prompts x G completions with real lengths and masks."""
    mask = (np.arange(N) < CLEN[..., None]).astype(np.float32)
    comps = np.where(mask > 0, rng.integers(1, 250, (P, G, N)), 0).astype(np.int32)
    return {"prompt_tokens": jnp.asarray(rng.integers(1, 250, (P, W)), jnp.int32),
            "prompt_lengths": jnp.asarray([3, 5], jnp.int32),
            "completions": jnp.asarray(comps), "completion_lengths": jnp.asarray(CLEN, jnp.int32),
            "comp_mask": jnp.asarray(mask), "sampler_logprobs": jnp.zeros((P, G, N))}


def _collector(num_prompts: int, batch_size: int, max_refills: int, shaping: Any = None):
    """A Collector over `num_prompts` prompts whose engine records the prompt indices of
    every round it is asked to sample (and samples nothing)."""
    from gpurl.rollout.collect import Collector, Shaping

    drawn: list[np.ndarray] = []

    def run(params, prompts, idx, group, seeds):
        drawn.append(np.asarray(idx))

    engine = SimpleNamespace(run=run, rewards=[])
    collector = Collector(engine, list(range(num_prompts)), group=2, batch_size=batch_size,
                          seed=7, shaping=shaping or Shaping(8), drop_equal=max_refills > 0,
                          rounds=1 + max_refills, batch_sharding=None, colocated=True,
                          pad_id=0)
    return collector, drawn


# ---------------------------------------------------------------- 1. the reward model's routes

def test_a_reward_model_routes_tokens_itself_not_by_the_policys_replayed_experts():
    """With routing replay the batch carries the experts the *policy's* sampler chose; a
    mixture-of-experts reward model scores with its own routing, routes or not."""
    from gpurl.algorithms.rm import reward_model_scores
    from gpurl.models.scalar import scalar_spec

    model = dict(TINY_MODEL, family="qwen3_moe", qk_norm=True, norm_plus_one=False,
                 scale_embeddings=False, activation="silu",
                 moe=MoEConfig(num_experts=4, experts_per_token=2, expert_mlp_dim=16))
    rm = scalar_spec(make_config(model=model).model)
    rng = np.random.default_rng(0)
    params = dict(rm.init(1), score=jnp.asarray(rng.normal(size=rm.cfg.d_model), jnp.float32))
    batch = _batch(rng)
    layers, k = rm.cfg.num_layers, rm.cfg.moe.experts_per_token
    # the policy's recorded experts: every completion token sent to experts 2 and 3
    routes = np.broadcast_to(np.asarray([2, 3], np.int16), (P, G, N, layers, k))
    own = np.asarray(reward_model_scores(rm, params, batch))
    replayed = np.asarray(reward_model_scores(rm, params, {**batch, "routes": jnp.asarray(routes)}))
    assert np.abs(own).max() > 1e-3
    np.testing.assert_allclose(replayed, own, atol=1e-6)


# ---------------------------------------------------------------- 2. the environment's reward

def test_an_environments_reward_counts_beside_a_reward_model():
    """With a reward model and no reward functions named, the functions only report
    (weight 0); the environment's trajectory reward still is the row's reward."""
    from gpurl.rollout.collect import Shaping
    from gpurl.rollout.rounds import Round, _with_env

    # the scorer's columns: the functions' weighted total, one function's score, failed
    scorer = jnp.asarray([[0.7, 0.7, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.3, 0.3, 0.0]])
    env_Bx3 = jnp.asarray([[1.0, 2, 0], [0.0, 1, 0], [1.0, 1, 0], [0.5, 3, 0]])  # reward, turns, error
    ids = jnp.asarray([0, 1, 2, -1])  # the last row is padding
    r = Round(local={}, lengths=jnp.asarray([5, 8, 3, 1]), scores=_with_env(scorer, env_Bx3, ids),
              functions=scorer[:, 0], row_ids=ids, positions=np.arange(3), rollout_s=0.0,
              reward_s=0.0, counts={}, sharding=None, env=env_Bx3)
    # the round's total (what evaluation reports) and reward/env's column
    np.testing.assert_allclose(r.scores[:, :2], [[1.7, 1.0], [0.0, 0.0], [2.0, 1.0], [0.3, 0.0]])
    reward_model_run, _ = _collector(8, 4, 0, Shaping(max_tokens=8, function_weight=0.0))
    np.testing.assert_allclose(reward_model_run.round_rewards(r), [1.0, 0.0, 1.0, 0.0])
    functions_too, _ = _collector(8, 4, 0, Shaping(max_tokens=8, function_weight=1.0))
    np.testing.assert_allclose(functions_too.round_rewards(r), [1.7, 0.0, 2.0, 0.0])


# ---------------------------------------------------------------- 3. the KL in the reward

@pytest.fixture(scope="module")
def tiny_policy():
    from gpurl.models import model_spec

    spec = model_spec(make_config(model=TINY_MODEL).model)
    return spec, spec.init(0)


def test_a_kl_penalty_in_the_reward_is_measured_from_the_trainers_logprobs(tiny_policy):
    """RLOO's KL in the reward at step 0 (policy == reference) is 0 whatever the sampler
    reported: the sampler's log-probs (bf16 paged decode on a GPU, or unreplayed experts)
    differ from the trainer's, and a KL from them would be a hidden length penalty."""
    from gpurl.algorithms import grpo
    from gpurl.algorithms.forward import group_logprobs
    from gpurl.algorithms.policy_gradient import group_advantages
    from gpurl.algorithms.rl import RLContext, RLInputs

    spec, params = tiny_policy
    rng = np.random.default_rng(1)
    batch = _batch(rng)
    trainer = group_logprobs(spec, params, batch, 1.0)[0]
    # the sampler saw every token as less likely than the trainer does
    batch["sampler_logprobs"] = (trainer - 0.3) * batch["comp_mask"]
    cfg = algo_config("rloo", num_generations=G, beta=0.05, kl_estimator="k1", kl_in_reward=True,
                      advantage="rloo", loss_agg="seq_mean_token_sum")
    rewards_B = jnp.asarray(rng.integers(0, 2, P * G), jnp.float32)
    out, metrics, _ = jax.jit(lambda x: grpo.prepare(cfg, RLContext(spec, 1.0), x))(
        RLInputs(params, params, None, batch, rewards_B, {}))
    np.testing.assert_allclose(out["advantages"],
                               group_advantages(rewards_B, G, "rloo").reshape(P, G), atol=1e-5)
    np.testing.assert_allclose(metrics["kl/rollout"], 0.0, atol=1e-6)
    assert "old_logprobs" not in out  # one pass: the loss's ratio is exactly 1


def test_behaviour_weights_match_a_numpy_transcription():
    """Decoupled PPO's truncated behaviour weight min(pi_old / pi_sampler, C) per token and
    its metrics (clip fraction, mean, effective sample size) over the masked tokens."""
    from gpurl.algorithms.behaviour import behaviour_weights

    rng = np.random.default_rng(2)
    old = rng.normal(-2, 0.5, (6, 5)).astype(np.float32)
    sampler = (old + rng.normal(0, 0.6, (6, 5))).astype(np.float32)
    mask = (rng.random((6, 5)) > 0.3).astype(np.float32)
    w, metrics = behaviour_weights(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), 1.5)
    want = np.minimum(np.exp(old - sampler), 1.5) * mask
    np.testing.assert_allclose(w, want, rtol=1e-6)
    on = mask > 0
    assert 0 < float(metrics["off_policy/weight_clip_fraction"]) < 1
    np.testing.assert_allclose(metrics["off_policy/weight_clip_fraction"],
                               (np.exp(old - sampler)[on] > 1.5).mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["off_policy/weight_mean"], want[on].mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["off_policy/ess"],
                               want[on].sum() ** 2 / (on.sum() * (want[on] ** 2).sum()), rtol=1e-5)
    # sequence level (verl's sequence-level TIS): min(prod_t pi_old / pi_sampler, C) per row
    sequence = np.minimum(np.exp(((old - sampler) * mask).sum(-1, keepdims=True)), 1.5) * mask
    w, metrics = behaviour_weights(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), 1.5,
                                   "sequence")
    np.testing.assert_allclose(w, sequence, rtol=1e-5)
    assert len({tuple(np.unique(row[m > 0])) for row, m in zip(np.asarray(w), mask)}) > 1
    np.testing.assert_allclose(metrics["off_policy/weight_mean"], sequence[on].mean(), rtol=1e-5)


def _np_read(log_r: np.ndarray, mask: np.ndarray, level: str) -> np.ndarray:
    """log r where a weight or mask reads it: per token; the sequence's product of ratios
    (sum of log r); their geometric mean (mean of log r over the sequence's tokens)."""
    log_r = log_r * mask
    if level == "token":
        return log_r
    total = log_r.sum(-1, keepdims=True)
    if level == "sequence":
        return np.broadcast_to(total, log_r.shape)
    return np.broadcast_to(total / np.maximum(mask.sum(-1, keepdims=True), 1), log_r.shape)


@pytest.mark.parametrize("level,band,cap", [
    ("token", (0.5, 5.0), 5.0),  # IcePop (Ling team 2025): r in [0.5, 5] weighted by r, else 0
    ("token", (0.0, 2.0), 2.0),  # token-level MIS (Liu, Li et al. 2025): r 1[r <= C]
    ("sequence", (0.5, 2.0), None),  # sequence-level rejection, no weight
    ("geometric", (0.8, 1.25), 2.0),  # geometric-mean rejection beside token TIS
])
def test_ratio_masks_match_numpy_transcriptions(level, band, cap):
    """Masked importance sampling: w = min(r, C) 1[low <= r_level <= high] (the first factor
    1 without C), 0 off the mask; the shares masked and truncated, the mean weight."""
    from gpurl.algorithms.behaviour import behaviour_weights

    rng = np.random.default_rng(5)
    old = rng.normal(-2, 0.5, (8, 6)).astype(np.float32)
    sampler = (old + rng.normal(0, 0.5, (8, 6))).astype(np.float32)
    mask = (rng.random((8, 6)) > 0.25).astype(np.float32)
    # a masked slot far off (a low temperature's padding): neutral, not NaN
    old_far = np.where(mask > 0, old, -5e3).astype(np.float32)
    w, metrics = behaviour_weights(jnp.asarray(old_far), jnp.asarray(sampler), jnp.asarray(mask),
                                   cap, "token", band, level)
    log_r = (old - sampler) * mask
    read = _np_read(log_r, mask, level)
    inside = (read >= np.log(band[0]) if band[0] > 0 else True) & (read <= np.log(band[1]))
    first = np.minimum(np.exp(log_r), cap) if cap is not None else np.ones_like(log_r)
    want = first * inside * mask
    np.testing.assert_allclose(w, want, rtol=1e-5, atol=1e-7)
    on = mask > 0
    masked = (~inside)[on].mean()
    assert 0 < masked < 1, masked  # the band binds, and not everywhere
    np.testing.assert_allclose(metrics["off_policy/masked_fraction"], masked, rtol=1e-6)
    np.testing.assert_allclose(metrics["off_policy/weight_mean"], want[on].mean(), rtol=1e-5)
    assert ("off_policy/weight_clip_fraction" in metrics) == (cap is not None)


def test_mismatch_metrics_match_numpy_and_take_the_maximum_over_micro_batches():
    """mismatch/*: with log r = log pi_old - log pi_sampler on the trained tokens, the mean
    and maximum |log r|, K3 (r - 1 - log r, KL(pi_sampler || pi_old)) and the share over
    the threshold; the maximum is reduced by max over micro-batches, the rest by sum."""
    from gpurl.algorithms.behaviour import mismatch_metrics
    from gpurl.algorithms.objective import reduce_micro

    rng = np.random.default_rng(6)
    old = rng.normal(-2, 0.5, (8, 6)).astype(np.float32)
    sampler = (old + rng.normal(0, 0.2, (8, 6))).astype(np.float32)
    mask = (rng.random((8, 6)) > 0.25).astype(np.float32)
    old_far = np.where(mask > 0, old, 5e3).astype(np.float32)  # masked slots: ignored
    n = jnp.float32(mask.sum())
    halves = [mismatch_metrics(jnp.asarray(old_far[i::2]), jnp.asarray(sampler[i::2]),
                               jnp.asarray(mask[i::2]), n, 0.1) for i in range(2)]
    got = reduce_micro({k: jnp.stack([h[k] for h in halves]) for k in halves[0]})
    log_r = (old - sampler)[mask > 0]
    want = {"mismatch/logprob_abs_mean": np.abs(log_r).mean(),
            "mismatch/logprob_abs_max": np.abs(log_r).max(),
            "mismatch/k3_kl": (np.exp(log_r) - 1 - log_r).mean(),
            "mismatch/over_threshold": (np.abs(log_r) > 0.1).mean()}
    assert 0 < want["mismatch/over_threshold"] < 1
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, err_msg=k)


# ---------------------------------------------------------------- 5. the data stream

def test_dynamic_sampling_draws_each_prompt_once_per_epoch_whatever_the_refills():
    """Under dynamic sampling (DAPO: up to 1 + 4 rounds per step) the data advances by
    the rounds actually run: with no refill needed, an epoch's steps draw every prompt
    exactly once; refills take the next prompts of the stream; a collector restored at
    a checkpoint's position draws what the uninterrupted one draws."""
    collector, drawn = _collector(num_prompts=20, batch_size=4, max_refills=4)
    for step in range(5):  # an epoch: 5 steps of 4 prompts, no refills
        collector.round(None, step, 0)
    np.testing.assert_array_equal(np.sort(np.concatenate(drawn)), np.arange(20))
    for rnd in range(3):  # step 5 refilled twice: the next three batches of the stream
        collector.round(None, 5, rnd)
    collector.round(None, 6, 0)
    epoch1 = np.concatenate(drawn[5:])
    assert len(epoch1) == 16 and len(set(epoch1.tolist())) == 16  # no prompt twice
    restored, again = _collector(num_prompts=20, batch_size=4, max_refills=4)
    restored.position = collector.position
    collector.round(None, 7, 0)
    restored.round(None, 7, 0)
    np.testing.assert_array_equal(again[-1], drawn[-1])
    assert set(drawn[-1].tolist()) | set(epoch1.tolist()) == set(range(20))  # epoch 1 complete


# ---------------------------------------------------------------- 4. rollouts a step ahead

@pytest.mark.e2e
def test_async_rounds_are_sampled_a_step_ahead_and_corrected(tmp_path):
    """rollout.mode=one_ahead with split placement on 2 host devices, 3 steps: step 2's round 0
    is sampled while step 1 trains, with the parameters step 1 started from (its sampler
    log-probs equal a rollout of those parameters, not of step 2's); step 2 computes pi_old
    with its own parameters and weights each token by min(pi_old / pi_sampler, 2), which
    is not 1; the lag is logged; the checkpointed data position leaves the round drawn
    ahead to be drawn again on resume."""
    from gpurl.algorithms.forward import group_logprobs
    from gpurl.distributed.mesh import using_devices
    from gpurl.rollout.rounds import row_seeds
    from gpurl.train.loop import build

    cfg = make_config(
        algo={"name": "grpo", "num_generations": 4, "beta": 0.0},
        model=dict(TINY_MODEL, tokenizer="bytes"), mesh={"placement": "split", "rollout_devices": 1},
        data={"name": "arithmetic", "num_train": 64, "num_eval": 8, "max_len": 16},
        optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant"},
        train={"steps": 3, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0},
        rollout={"max_new_tokens": 8, "temperature": 1.0, "mode": "one_ahead"},
        logger={"progress": False}, run={"dir": str(tmp_path / "async")},
        rewards=["test_grpo:printable"])
    with using_devices(jax.devices()[:2]):
        cfg, setup, stepper = build(cfg)
        assert stepper.overlap and "one step ahead corrected" in stepper.describe()
        prepared, real = [], stepper._prepare
        stepper._prepare = lambda *a: prepared.append(real(*a)) or prepared[-1]
        policy = lambda state: jax.tree.map(jnp.copy, setup.spec.policy_params(state.params))  # noqa: E731
        state = setup.init()
        state, m0 = stepper.step(state, 0)
        theta1 = policy(state)
        state, m1 = stepper.step(state, 1)
        theta2 = policy(state)
        ahead_step, ahead = stepper.source.prefetched
        assert ahead_step == 2
        assert stepper.state_meta()["data_position"] == stepper.collector.position - 1 == 2
        position = stepper.collector.position - 1
        state, m2 = stepper.step(state, 2)

        def rollout(params):
            idx = stepper.collector.indices(position)
            r = stepper.rounds.run(stepper.sync(params), stepper.prompts, idx, 4,
                                   row_seeds(cfg.train.seed, 2, 0, len(idx) * 4))
            return np.asarray(r.rollout.tokens), np.asarray(r.rollout.logprobs)

        tokens1, logprobs1 = rollout(theta1)
        np.testing.assert_array_equal(np.asarray(ahead.rollout.tokens), tokens1)
        np.testing.assert_allclose(np.asarray(ahead.rollout.logprobs), logprobs1, atol=1e-6)
        tokens2, logprobs2 = rollout(theta2)
        real_tokens = np.asarray(ahead.rollout.lengths)[:, None] > np.arange(tokens1.shape[1])
        assert (np.abs(logprobs2 - logprobs1)[real_tokens & (tokens2 == tokens1)].max() > 1e-3
                or (tokens2 != tokens1).any())

    assert [float(m["off_policy/lag"]) for m in (m0, m1, m2)] == [0.0, 1.0, 1.0]
    # measured on every step: ~0 on the fresh round (one model, fp32), the lag after
    gaps = [float(m["mismatch/logprob_abs_mean"]) for m in (m0, m1, m2)]
    assert gaps[0] < 1e-4 < 1e-3 < min(gaps[1:]), gaps
    batch, metrics, _ = prepared[2]
    mask = np.asarray(batch["comp_mask"]) > 0
    # pi_old: the trainer's policy at the start of step 2, computed here independently
    old = np.asarray(jax.jit(lambda p, b: group_logprobs(setup.spec.policy, p, b)[0])(theta2, batch))
    sampler, weights = np.asarray(batch["sampler_logprobs"]), np.asarray(batch["is_weights"])
    assert "old_logprobs" not in batch  # one pass over the batch: the ratio is exactly 1
    np.testing.assert_allclose(weights[mask], np.minimum(np.exp(old - sampler), 2.0)[mask], rtol=1e-5)
    assert np.abs(weights[mask] - 1.0).max() > 1e-3  # the stale round is corrected
    assert 0.0 <= float(metrics["off_policy/weight_clip_fraction"]) <= 1.0
    assert float(metrics["off_policy/ess"]) < 1.0


def test_ppo_corrects_rounds_sampled_ahead_as_the_grpo_family_does():
    """PPO's prepare step (pi_old always computed) weights a batch that may hold a round
    sampled ahead by the same truncated weights, and none on a synchronous run."""
    from gpurl.algorithms import ppo
    from gpurl.algorithms.rl import RLContext, RLInputs
    from gpurl.models.scalar import ActorCriticSpec

    cfg = algo_config("ppo", num_generations=G, beta=0.0, kl_in_reward=True)
    spec = ActorCriticSpec.of(make_config(model=TINY_MODEL).model, cfg.critic)
    params = spec.init(0)
    batch = _batch(np.random.default_rng(3))
    batch["sampler_logprobs"] = jnp.full((P, G, N), -5.5) * batch["comp_mask"]
    rewards_B = jnp.linspace(0.0, 1.0, P * G)

    def prepare(off_policy: bool):
        return jax.jit(lambda x: ppo.prepare(cfg, RLContext(spec, 1.0, off_policy=off_policy), x))(
            RLInputs(params, None, None, batch, rewards_B, ppo.initial_carry(cfg)))

    out, metrics, _ = prepare(True)
    mask = np.asarray(batch["comp_mask"]) > 0
    want = np.minimum(np.exp(np.asarray(out["old_logprobs"]) + 5.5), 2.0)
    np.testing.assert_allclose(np.asarray(out["is_weights"])[mask], want[mask], rtol=1e-5)
    assert "off_policy/weight_clip_fraction" in metrics
    synchronous, metrics, _ = prepare(False)
    assert "is_weights" not in synchronous and "off_policy/ess" not in metrics


def test_async_without_correction_is_an_explicit_choice():
    """algo.async_correction=false trains rounds sampled a step ahead without weights
    (unless algo.tis_cap asks for them on every run); algo.tis_cap sets C; pi_old enters
    the loss's ratio only when a batch is trained more than once."""
    from gpurl.algorithms.behaviour import (ASYNC_TIS_CAP, behaviour_cap,
                                           needs_old_logprobs, ratio_uses_old)

    grpo = algo_config("grpo")
    assert behaviour_cap(grpo, off_policy=False) is None and not needs_old_logprobs(grpo, False)
    assert behaviour_cap(grpo, off_policy=True) == ASYNC_TIS_CAP == 2.0
    assert behaviour_cap(dataclasses.replace(grpo, tis_cap=3.0), off_policy=True) == 3.0
    off = dataclasses.replace(grpo, async_correction=False)
    assert behaviour_cap(off, off_policy=True) is None and needs_old_logprobs(off, True)
    assert behaviour_cap(dataclasses.replace(off, tis_cap=1.5), off_policy=True) == 1.5
    assert not ratio_uses_old(grpo) and ratio_uses_old(dataclasses.replace(grpo, num_iterations=2))

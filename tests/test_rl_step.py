"""Pieces of the RL step on constructed inputs: DAPO's overlong shaping and dynamic
sampling, and the prompt + completion sequences the trainer sees."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.rollout.collect import Collector, group_spread, overlong_penalty, select_groups


def dapo_overlong_reference(length: int, l_max: int, l_cache: int) -> float:
    """Yu et al. 2025 (DAPO), eq. 13, transcribed case by case."""
    if length <= l_max - l_cache:
        return 0.0
    if l_max - l_cache < length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_overlong_penalty_matches_dapo_eq13():
    lengths = np.arange(0, 21)
    got = overlong_penalty(lengths, max_tokens=20, buffer=8, factor=1.0)
    want = [dapo_overlong_reference(n, 20, 8) for n in lengths]
    np.testing.assert_allclose(got, want, atol=1e-7)
    assert got[12] == 0.0 and got[20] == -1.0 and got[16] == -0.5
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 8, 0.5), np.asarray(want) * 0.5)
    # Off when disabled, or when the buffer is not shorter than the limit.
    assert not overlong_penalty(lengths, 20, 0, 1.0).any()
    assert not overlong_penalty(lengths, 20, 20, 1.0).any()


def test_dynamic_sampling_drops_groups_with_equal_rewards():
    rewards = np.asarray([1, 1, 1, 1,   0, 1, 0, 0,   0, 0, 0, 0,   0.5, 0.5, 0.5, 0.25],
                         np.float32)
    informative = np.asarray(group_spread(jnp.asarray(rewards), 4)) > 1e-9
    keep, drop = select_groups(informative, num_groups=4, wanted=4)
    assert keep.tolist() == [1, 3] and drop.tolist() == [0, 2]
    keep, drop = select_groups(None, num_groups=4, wanted=4)
    assert keep.tolist() == [0, 1, 2, 3] and drop.tolist() == []


def test_batch_is_grouped_by_prompt():
    pad = 0
    fake = SimpleNamespace(pad_id=pad, group=2)
    prompt_BxW = jnp.asarray([[5, 6, 7, pad], [5, 6, 7, pad], [3, pad, pad, pad], [3, pad, pad, pad]])
    plen_B = jnp.asarray([3, 3, 1, 1])
    comp_BxN = jnp.asarray([[11, 12, 99], [13, pad, pad], [14, 15, 16], [17, 18, pad]])
    clen_B = jnp.asarray([2, 1, 3, 2])
    clp_BxN = jnp.asarray([[-1.0, -2.0, -9.0], [-3.0, 0.0, 0.0], [-4.0, -5.0, -6.0],
                           [-7.0, -8.0, 0.0]])
    rewards_B = jnp.asarray([0.1, 0.2, 0.3, 0.4])
    select_B = jnp.asarray([2, 3, 0, 1])  # groups in a new order, each kept whole
    keep_B = jnp.asarray([True, True, False, False])
    out, rewards = Collector._assemble_fn(
        fake, [{"prompt_tokens": prompt_BxW, "prompt_lengths": plen_B, "completions": comp_BxN,
                "completion_lengths": clen_B, "sampler_logprobs": clp_BxN, "rewards": rewards_B}],
        select_B, keep_B)
    np.testing.assert_allclose(rewards, [0.3, 0.4, 0.1, 0.2])  # each row keeps its reward
    np.testing.assert_array_equal(out.prompt_tokens, [[3, 0, 0, 0], [5, 6, 7, 0]])
    np.testing.assert_array_equal(out.prompt_lengths, [1, 3])
    # Tokens after a completion's end (99: sampled past the stop) become padding.
    np.testing.assert_array_equal(out.completions, [[[14, 15, 16], [17, 18, 0]],
                                                       [[11, 12, 0], [13, 0, 0]]])
    np.testing.assert_array_equal(out.completion_lengths, [[3, 2], [2, 1]])
    # Loss on real completion tokens only, and none on a filler group (keep False).
    np.testing.assert_array_equal(out.comp_mask, [[[1, 1, 1], [1, 1, 0]],
                                                     [[0, 0, 0], [0, 0, 0]]])
    np.testing.assert_allclose(out.sampler_logprobs[1], [[-1, -2, 0], [-3, 0, 0]])


# Gemma 3's pattern (sliding-window layers with their own RoPE base around a global one,
# a window shorter than prompt + completion), rematerialized: the PromptKV path under a
# checkpointed scan.
_PATTERNED_REMAT = dict(TINY_MODEL, family="gemma3", num_layers=3, post_norms=True,
                        qk_norm=True, sliding_window=3, global_every=3, rope_local_theta=100.0,
                        rope_theta=1e4, remat="full")


@pytest.mark.parametrize("model", [TINY_MODEL, pytest.param(_PATTERNED_REMAT, marks=pytest.mark.slow)],
                         ids=["llama", "gemma3_remat"])
@pytest.mark.slow
def test_group_logprobs_equal_full_sequence_logprobs_and_gradients(model):
    """Sharing each prompt's forward pass across its G completions changes nothing: values
    and parameter gradients equal the plain forward pass over prompt + completion (with
    every layer's prompt keys and values scanned with the layers, rematerialized or not)."""
    import jax

    from gpurl.algorithms.forward import group_logprobs, token_logprobs
    from gpurl.models import model_spec

    spec = model_spec(make_config(model=model).model)
    params = spec.init(0)
    rng = np.random.default_rng(0)
    p, g, n, w = 2, 3, 4, 8
    plen = np.asarray([3, 5])
    clen = np.asarray([[4, 2, 1], [3, 4, 2]])
    prompts = np.zeros((p, w), np.int32)
    for i in range(p):
        prompts[i, :plen[i]] = rng.integers(1, 250, plen[i])
    comps = rng.integers(1, 250, (p, g, n)).astype(np.int32)
    comps = np.where(np.arange(n) < clen[..., None], comps, 0)
    mask = (np.arange(n) < clen[..., None]).astype(np.float32)
    weights = rng.normal(size=(p, g, n)).astype(np.float32) * mask
    grouped = {"prompt_tokens": jnp.asarray(prompts), "prompt_lengths": jnp.asarray(plen),
               "completions": jnp.asarray(comps), "completion_lengths": jnp.asarray(clen)}
    s = w + n
    full = np.zeros((p * g, s), np.int32)
    seg = np.zeros((p * g, s), np.int32)
    for i in range(p):
        for j in range(g):
            row = np.concatenate([prompts[i, :plen[i]], comps[i, j, :clen[i, j]]])
            full[i * g + j, :len(row)] = row
            seg[i * g + j, :len(row)] = 1
    flat = {"tokens": jnp.asarray(full), "segment_ids": jnp.asarray(seg),
            "positions": jnp.broadcast_to(jnp.arange(s), (p * g, s))}
    idx = np.repeat(plen, g)[:, None] - 1 + np.arange(n)[None]  # predicts completion token j

    def ours(params):
        logp, _ = group_logprobs(spec, params, grouped, temperature=0.7, chunk_size=16)
        return (logp * weights).sum(), logp

    def reference(params):
        logp_BxT = token_logprobs(spec.apply, params, flat, temperature=0.7)
        logp = jnp.take_along_axis(logp_BxT, jnp.asarray(idx), axis=1).reshape(p, g, n)
        return (logp * weights).sum(), logp * mask

    (v1, lp1), g1 = jax.jit(jax.value_and_grad(ours, has_aux=True))(params)
    (v2, lp2), g2 = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(lp1) * mask, lp2, atol=1e-5)
    np.testing.assert_allclose(v1, v2, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):  # fp32, relative to the scale
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * max(1.0, float(np.abs(b).max())))


@pytest.mark.slow
def test_grpo_prepare_adds_a_reward_models_score_before_the_group_advantages():
    """algo.reward_model works for the GRPO family as for PPO: its score of each completion
    joins the functions' reward on device, before the advantages."""
    from conftest import TINY_MODEL, algo_config, make_config
    from gpurl.algorithms import grpo
    from gpurl.algorithms.policy_gradient import group_advantages
    from gpurl.algorithms.rl import RLContext, RLInputs
    from gpurl.algorithms.rm import reward_model_scores
    from gpurl.models import model_spec
    from gpurl.models.scalar import scalar_spec

    spec = model_spec(make_config(model=TINY_MODEL).model)
    rm = scalar_spec(spec.cfg)
    rng = np.random.default_rng(1)
    rm_params = dict(rm.init(1), score=jnp.asarray(rng.normal(size=spec.cfg.d_model), jnp.float32))
    p, g, n, w = 2, 3, 4, 8
    clen = np.asarray([[4, 2, 1], [3, 4, 2]])
    batch = {"prompt_tokens": jnp.asarray(rng.integers(1, 250, (p, w)), jnp.int32),
             "prompt_lengths": jnp.asarray([3, 5]),
             "completions": jnp.asarray(rng.integers(1, 250, (p, g, n)), jnp.int32),
             "completion_lengths": jnp.asarray(clen),
             "comp_mask": jnp.asarray(np.arange(n) < clen[..., None], jnp.float32),
             "sampler_logprobs": jnp.zeros((p, g, n))}
    rewards_B = jnp.asarray(rng.integers(0, 2, p * g), jnp.float32)
    out, metrics, carry = grpo.prepare(
        algo_config("grpo", num_generations=g), RLContext(spec, 1.0, rm),
        RLInputs(spec.init(0), None, rm_params, batch, rewards_B, {}))
    scores_B = reward_model_scores(rm, rm_params, batch)
    assert float(jnp.abs(scores_B).max()) > 1e-3  # the reward model's scores matter here
    np.testing.assert_allclose(out["advantages"], group_advantages(
        rewards_B + scores_B, g, "grpo").reshape(p, g), rtol=1e-6)
    np.testing.assert_allclose(metrics["reward/model"], scores_B.mean(), rtol=1e-6)
    assert carry == {}


@pytest.mark.slow
def test_a_rounds_tokens_cross_to_a_device_once(tmp_path, monkeypatch):
    """Split placement, one GRPO step with dynamic sampling (several rounds): each round's
    completion tokens and sampler log-probs go from this host to the trainer's devices
    once, and no device array of them comes back to a host (scoring sends the devices only
    row ids; before, the tokens went to the rollout devices, back to the host to be scored,
    and back again to reach the trainer); the packing plan's lengths come from the hosts'
    copies and equal the assembled batch's."""
    import jax

    from gpurl.distributed import host
    from gpurl.distributed.mesh import using_devices
    from gpurl.train.loop import build

    cfg = make_config(
        algo={"name": "grpo", "num_generations": 4, "beta": 0.0, "dynamic_sampling": True,
              "max_refills": 2},
        model=dict(TINY_MODEL, tokenizer="bytes"), mesh={"placement": "split", "rollout_devices": 1},
        data={"name": "arithmetic", "num_train": 16, "num_eval": 4, "max_len": 16},
        train={"steps": 1, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0},
        rollout={"max_new_tokens": 8, "decode_chunk": 3}, logger={"progress": False},
        run={"dir": str(tmp_path)})
    # the prepare step's watcher thread wakes only once the train phase's end is taken (as
    # a loaded host may schedule it): time/prepare_s still reads as a part of time/train_s
    from gpurl.train import metrics as timers

    ended, wait, observe = threading.Event(), timers.DeviceTimer._wait, timers.DeviceTimer.observe
    monkeypatch.setattr(timers.DeviceTimer, "_wait", lambda self: ended.wait(60) and wait(self))
    monkeypatch.setattr(timers.DeviceTimer, "observe", lambda self, at=None: (
        observe(self, at), self._watcher is None and ended.set()) and None)
    puts, fetched, rounds, got = [], [], [], []
    to_device, local_rows, to_host = host.to_device, host.local_rows, host.to_host
    monkeypatch.setattr(host, "to_device", lambda x, sharding: puts.append(x) or to_device(x, sharding))
    monkeypatch.setattr(host, "local_rows", lambda a: fetched.append(a.shape) or local_rows(a))
    monkeypatch.setattr(host, "to_host", lambda a: fetched.append(a.shape) or to_host(a))
    with using_devices(jax.devices()[:2]):
        cfg, setup, stepper = build(cfg)
        run = stepper.rounds.run
        stepper.rounds.run = lambda *a, **k: rounds.append(run(*a, **k)) or rounds[-1]
        collect = stepper.collector.collect
        stepper.collector.collect = lambda *a: got.append(collect(*a)) or got[-1]
        state, metrics = stepper.step(setup.init(), 0)
        jax.block_until_ready(state)
        fetches = len(fetched)
        train_s = float(metrics["time/train_s"])
        assert 0 < float(metrics["time/prepare_s"]) <= train_s
        batch = got[0].batch
        want = np.concatenate([np.asarray(batch.prompt_lengths)[:, None],
                               np.asarray(batch.completion_lengths)], axis=1)
        np.testing.assert_array_equal(got[0].lengths(), want)
        # the typed batch has the shapes its spec declares (what the plan compiles)
        shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]  # noqa: E731
        assert shapes(batch) == shapes(stepper.collector.spec())
    assert len(rounds) == 3  # a tiny random model's groups are all equal: two refills
    for r in rounds:
        for name in ("tokens", "logprobs", "prompt_tokens"):
            assert sum(x is r.local[name] for x in puts) == 1, name
        assert r.local["tokens"].shape == (16, 8)
        assert "rollout" not in vars(r)  # never put on the rollout mesh
    assert (16, 8) not in fetched[:fetches] and (4, 5) not in fetched[:fetches]

"""Continuous rollouts (`rollout.mode=continuous`, `gpurl.rollout.continuous`): the engine never
stops, new weights enter between decode chunks, each step trains the first groups ready,
no trained token is older than `rollout.max_lag` versions, and a deterministic swap
schedule (`rollout.swap_chunks`) makes a run bit-reproducible."""

from __future__ import annotations

import string
from typing import Any

import jax
import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.config import ConfigError, RolloutConfig
from gpurl.plan.memory import plan_rollout


def _config(tmp_path, **rollout: Any):
    return make_config(
        algo={"name": "grpo", "num_generations": 4, "beta": 0.0},
        model=dict(TINY_MODEL, tokenizer="bytes"), mesh={"placement": "split", "rollout_devices": 1},
        data={"name": "arithmetic", "num_train": 64, "num_eval": 4, "max_len": 16},
        optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant"},
        train={"steps": 4, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0},
        rollout={"max_new_tokens": 8, "decode_chunk": 2, "mode": "continuous", **rollout},
        logger={"progress": False}, run={"dir": str(tmp_path)}, rewards=["test_grpo:printable"])


def _run(cfg, steps: int, after: Any = None) -> tuple[list[dict], list[list], Any]:
    """`steps` steps on 2 host devices (1 rollout, 1 trainer): each step's metrics, the
    completions it trained (`Completion.versions` per token), the final parameters;
    `after(stepper)` runs last, on those devices."""
    from gpurl.distributed.mesh import using_devices
    from gpurl.train.loop import build

    with using_devices(jax.devices()[:2]):
        cfg, setup, stepper = build(cfg)
        trained, score = [], stepper.rounds.score
        stepper.rounds.score = lambda p, i, done, *a: trained.append(done) or score(p, i, done, *a)
        state, metrics = setup.init(), []
        for step in range(steps):
            state, m = stepper.step(state, step)
            metrics.append({k: float(v) for k, v in m.items() if k != "time/train_s"
                            and not k.startswith("time/")})
        if after is not None:
            after(stepper)
        return metrics, trained, jax.tree.map(np.asarray, state.params)


def _planned_pools(stepper) -> None:
    """The memory plan counts the pools a continuous run holds: the stream's (its
    rollout.in_flight batches) at least as large as the one it allocated, and an
    evaluation's beside it."""
    round_ = stepper.rollout_round()
    plan = plan_rollout(round_, limit=2.0**40)
    pool = stepper.source.stream.pool
    held = sum(x.addressable_shards[0].data.nbytes for x in pool)
    rows, width = round_.rows, round_.width
    assert held > stepper.engine.pool_bytes(rows, width)  # more than one batch's pool
    assert plan.parts["KV cache"] >= held
    assert plan.parts["KV cache (evaluation)"] == stepper.engine.pool_bytes(
        stepper.train.eval_batch_size, width) > 0


# Letters stop a completion (about one token in five of the random model), so lengths run
# from 1 to 16 tokens: most groups finish within a few iterations, some take 8.
LONG_TAIL = {"max_new_tokens": 16, "stop": list(string.ascii_letters)}


def _check_lags(metrics: list[dict], trained: list[list], max_lag: int) -> None:
    """No token trained at step s is older than s - max_lag, the lag metrics say what the
    tokens say, and the long tail was trained (lengths 1-3 to 16)."""
    for step, (done, m) in enumerate(zip(trained, metrics)):
        versions = np.concatenate([c.versions for c in done])
        assert len(done) == 16 and versions.min() >= step - max_lag and versions.max() <= step
        assert m["off_policy/lag_max"] == step - versions.min()
        np.testing.assert_allclose(m["off_policy/lag"], (step - versions).mean(), rtol=1e-6)
    lengths = np.concatenate([[len(c.tokens) for c in done] for done in trained])
    assert lengths.min() < 4 and lengths.max() == 16
    assert any(len(set(c.versions.tolist())) > 1 for done in trained for c in done)


@pytest.mark.e2e
def test_continuous_batches_hold_no_token_older_than_the_bound(tmp_path):
    """max_lag=1, one batch in flight, weights swapped after one scheduling iteration of
    each step, long-tailed lengths: completions span two versions, every token trained at
    step s was sampled by version s - 1 or s, the lag metrics say so, the truncated
    importance weights are not all 1, and no group was sampled again."""
    metrics, trained, _ = _run(_config(tmp_path, max_lag=1, swap_chunks=1, in_flight=1,
                                       **LONG_TAIL), 5)
    _check_lags(metrics, trained, 1)
    assert any(m["off_policy/weight_mean"] != 1.0 for m in metrics[1:])
    assert all(m["mismatch/logprob_abs_max"] > 0 for m in metrics[1:])  # stale tokens, measured
    assert [m["rollout/restarted"] for m in metrics] == [0.0] * 5


@pytest.mark.e2e
def test_long_completions_are_trained_not_started_over(tmp_path):
    """Earliest deadline first: max_lag=2, two batches in flight, new weights after every
    scheduling iteration and long-tailed lengths. Ready-first alone lets the short groups
    overtake the long ones until those pass the bound and start over (8 requests at step 3
    before this was fixed: the long tail dropped from training); a group whose oldest token
    is max_lag versions old is now due, so none starts over. The memory plan counts the
    stream's pool of two batches and an evaluation's beside it."""
    metrics, trained, _ = _run(_config(tmp_path, max_lag=2, swap_chunks=1, in_flight=2,
                                       **LONG_TAIL), 6, after=_planned_pools)
    _check_lags(metrics, trained, 2)
    assert [m["rollout/restarted"] for m in metrics] == [0.0] * 6
    assert max(m["off_policy/lag_max"] for m in metrics) == 2


@pytest.mark.e2e
def test_a_deterministic_swap_schedule_reproduces_a_run_bit_for_bit(tmp_path):
    """rollout.swap_chunks=2: two runs of 3 steps give the same metrics and parameters."""
    cfg = _config(tmp_path, max_lag=2, swap_chunks=2)
    first, second = _run(cfg, 3), _run(cfg, 3)
    assert first[0] == second[0]
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first[2]),
                                                    jax.tree.leaves(second[2])))
    for a, b in zip(first[1], second[1]):
        assert all(np.array_equal(x.tokens, y.tokens) and np.array_equal(x.versions, y.versions)
                   for x, y in zip(a, b))


def test_continuous_mode_needs_split_placement_and_a_lag(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout.mode='fast' is not valid; use one of: "
                                          r"sync, one_ahead, continuous\.$"):
        RolloutConfig(mode="fast")
    with pytest.raises(ConfigError, match=r"^rollout.in_flight=3 is more than rollout.max_lag=2: "
                                          r".* set rollout.in_flight<=2 or rollout.max_lag>=3\.$"):
        RolloutConfig(mode="continuous", in_flight=3)
    with pytest.raises(ConfigError, match=r"^rollout.max_lag=0 .* set rollout.max_lag>=1 or "
                                          r"rollout.mode=one_ahead\.$"):
        RolloutConfig(mode="continuous", max_lag=0)
    from gpurl.train.loop import build

    cfg = make_config(algo={"name": "grpo", "num_generations": 4},
                      model=dict(TINY_MODEL, tokenizer="bytes"), data={"name": "arithmetic",
                      "num_train": 8, "num_eval": 0, "max_len": 16},
                      train={"steps": 1, "batch_size": 4, "eval_every": 0},
                      rollout={"max_new_tokens": 4, "mode": "continuous"},
                      logger={"progress": False}, run={"dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"^rollout.mode=continuous needs mesh.placement=split "
                                          r".*\(rollout.mode=one_ahead\)\.$"):
        build(cfg)


@pytest.mark.e2e
def test_dynamic_sampling_replaces_uninformative_groups_from_the_stream(tmp_path):
    """Continuous rollouts with dynamic sampling: addition prompts score 1.0 on every
    completion (no signal), so their groups are dropped and the step streams on, scoring
    more rounds, until 4 informative groups are kept; no token trained is older than the
    bound, and the dropped groups' prompts are replaced by new draws from the data."""
    import dataclasses

    from conftest import with_rewards

    cfg = _config(tmp_path, max_lag=2, swap_chunks=1, in_flight=2)
    cfg = with_rewards(dataclasses.replace(cfg, algo=dataclasses.replace(
        cfg.algo, dynamic_sampling=True, max_refills=4)), "test_grpo:constant_on_addition")
    metrics, scored, _ = _run(cfg, 4)
    assert all(m["groups/kept"] == 4 and m["reward/batch_mean"] < 1.0 for m in metrics)
    refilled = [m for m in metrics if m["rollout/rounds"] > 1]
    assert refilled and all(m["groups/all_equal"] > 0 for m in refilled)
    assert len(scored) == sum(m["rollout/rounds"] for m in metrics)  # a round per score
    assert all(m["off_policy/lag_max"] <= 2 for m in metrics)
    assert any(m["off_policy/lag_max"] > 0 for m in metrics)


def _env_config(tmp_path, **rollout: Any):
    """Continuous GRPO on guess-the-number trajectories of up to 3 turns (tests/rl_envs.py
    CountedGuess: each environment step is logged per process)."""
    return make_config(
        algo={"name": "grpo", "num_generations": 4, "beta": 0.0},
        model=dict(TINY_MODEL, tokenizer="bytes"), mesh={"placement": "split", "rollout_devices": 1},
        data={"name": "guess_number", "num_train": 32, "num_eval": 0, "max_len": 256, "few_shot": 1},
        optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant"},
        train={"steps": 4, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0},
        rollout={"max_new_tokens": 4, "decode_chunk": 2, "mode": "continuous", **rollout},
        env={"name": "rl_envs:CountedGuess", "max_turns": 3, "max_tokens": 32},
        logger={"progress": False}, run={"dir": str(tmp_path)})


@pytest.mark.e2e
def test_multi_turn_trajectories_stream_through_continuous_rollouts(tmp_path, monkeypatch):
    """Continuous rollouts of multi-turn trajectories: each turn's environment step runs
    between decode chunks as the row's turn ends (once per turn, turns 1, 2, ... in
    order), the next turn finds the trajectory so far in the prefix cache, trajectories
    span policy versions, and no model token trained is older than the bound."""
    monkeypatch.setenv("GPURL_TEST_COUNT_DIR", str(tmp_path))
    metrics, scored, _ = _run(_env_config(tmp_path / "run", max_lag=2, swap_chunks=1,
                                          in_flight=2), 4)
    assert all(1 <= m["env/turns"] <= 3 for m in metrics) and any(m["env/turns"] > 1 for m in metrics)
    assert all(m["off_policy/lag_max"] <= 2 for m in metrics)
    assert any(m["off_policy/lag_max"] > 0 for m in metrics)
    assert any(m["rollout/prefix_hit_rate"] > 0 for m in metrics)
    turns: dict[str, list[int]] = {}
    for line in next(tmp_path.glob("[0-9]*")).read_text().split("\n"):
        if line:
            traj, turn = line.split()
            turns.setdefault(traj, []).append(int(turn))
    assert all(t == list(range(1, len(t) + 1)) for t in turns.values())
    assert len(turns) >= 4 * 4 * 4  # every trajectory trained had its own environment


def _agent_config(tmp_path, env: dict, **rollout: Any):
    """Continuous GRPO at a learning rate below every weight's rounding on three-turn trajectories of PrintableGame (tests/rl_envs.py),
    played in-process (`env`: the class) or by an agent through the gateway
    (rl_agents:printable): the weights never change, so the versions are labels only and
    both sample the same tokens."""
    return make_config(
        algo={"name": "grpo", "num_generations": 4, "beta": 0.0},
        model=dict(TINY_MODEL, tokenizer="bytes"), mesh={"placement": "split", "rollout_devices": 1},
        data={"name": "arithmetic", "num_train": 32, "num_eval": 4, "max_len": 64},
        optim={"lr": 1e-30, "warmup_steps": 0, "decay": "constant"},  # updates round away
        train={"steps": 3, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0},
        rollout={"max_new_tokens": 6, "decode_chunk": 2, "mode": "continuous", "swap_chunks": 1,
                 **rollout},
        env={"max_turns": 3, "max_tokens": 64, "stop": ["\\n"], **env},
        logger={"progress": False}, run={"dir": str(tmp_path)})


AGENT = {"name": "agent", "agent": "rl_agents:printable", "agent_rows": 1}


@pytest.mark.e2e
def test_agents_play_in_the_continuous_stream_as_environments_do(tmp_path):
    """env=agent in continuous mode: each group's agents start when it is drawn, their calls
    join the run's stream and span weight swaps, every model token records its version and
    none trained is older than the bound; with one batch in flight the steps train the same
    trajectories as the in-process environment (the same tokens: rewards, turns and losses
    equal to fp32 rounding), and an evaluation between steps plays its own sessions on its
    own stream and scores what the environment's does."""
    from gpurl.distributed.mesh import using_devices
    from gpurl.train.loop import build

    def run(cfg):
        with using_devices(jax.devices()[:2]):
            cfg, setup, stepper = build(cfg)
            trained, score = [], stepper.rounds.score_agents
            stepper.rounds.score_agents = lambda p, i, groups, *a: (
                trained.append([g.versions() for g in groups]) or score(p, i, groups, *a))
            state, metrics = setup.init(), []
            for step in range(3):
                state, m = stepper.step(state, step)
                # held-out rows played greedily beside the run's stream (its own sessions)
                metrics.append({**{k: float(v) for k, v in m.items()},
                                **stepper.evaluate(state.params)})
            stepper.close()
            return metrics, trained

    agents, trained = run(_agent_config(tmp_path / "agent", AGENT, max_lag=1, in_flight=1))
    env = run(_agent_config(tmp_path / "env", {"name": "rl_envs:PrintableGame"},
                            max_lag=1, in_flight=1))[0]
    for step, (a, e, versions) in enumerate(zip(agents, env, trained)):
        assert a["agent/calls"] == 3 and a["agent/failed"] == 0
        for key in ("reward/mean", "reward/std", "loss", "env/turns", "completion/length",
                    "eval/reward", "eval/accuracy"):
            assert a[key] == pytest.approx(e[key], rel=1e-6, abs=1e-7), key
        tokens = np.concatenate([np.asarray(v) for v in versions])
        assert len(versions) == 4 and tokens.min() >= step - 1 and tokens.max() <= step
        assert a["off_policy/lag_max"] == step - tokens.min()
    # the first decode chunk of a step samples with the old weights, the rest with the new
    assert any(len(set(v)) > 1 for versions in trained[1:] for v in versions)
    assert len({round(a["reward/mean"], 6) for a in agents}) > 1  # not a constant


@pytest.mark.e2e
def test_a_checkpoint_keeps_ended_agent_groups_and_plays_the_others_again(tmp_path):
    """A continuous agent run's checkpoint (`Continuous.state_meta`) holds the groups whose
    agents all ended (their rows, versions and rewards) and names the groups still playing
    (held by the test until their first calls are in the stream); a run restored from it
    drops the calls the checkpoint's stream held, plays those groups again from their start
    with new agents, and trains on."""
    import json
    import time

    import rl_agents
    from gpurl.distributed.mesh import using_devices
    from gpurl.train.loop import build

    held = {**AGENT, "agent": "rl_agents:printable_held_on_7"}
    rl_agents.HOLD.clear()
    try:
        with using_devices(jax.devices()[:2]):
            cfg, setup, stepper = build(_agent_config(tmp_path / "a", held, max_lag=2, in_flight=2))
            state, _ = stepper.step(setup.init(), 0)
            source = stepper.source
            waiting = {p for p, g in ((g.prompt, g) for g in source.groups.values())
                       if str(source.prompts.rows[p]["answer"]).endswith("7")}
            while not all(g.ready for g in source.groups.values() if g.prompt not in waiting):
                source.agents.admit()  # the run's stream goes on until the others ended
                busy = source.stream.iterate(source.params, source.version)
                for index, completion in source.stream.finished():
                    source.agents.deliver(index, completion)
                source.agents.served(busy)
            rl_agents.HOLD.set()  # the held agents' first calls are in the stream at the checkpoint
            driver = source.agents.continuous
            while driver.queued() < 4 * len(waiting):
                time.sleep(0.01)
            source.agents.admit()
            assert len(source.stream.unfinished()) == 4 * len(waiting)
            meta = json.loads(json.dumps(stepper.source.state_meta()))
            before = {g.prompt: g for g in source.groups.values()}
            ended = {p for p, g in before.items() if g.ready}
            assert len(before) == 4 and ended == set(before) - waiting and 0 < len(waiting) < 4
            stepper.close()

            cfg, setup, resumed = build(_agent_config(tmp_path / "b", held, max_lag=2, in_flight=2))
            resumed.restore_meta(meta)
            kept = {g.prompt: g for g in resumed.source.groups.values()}
            assert set(kept) == ended
            assert sorted(p for p, *_ in resumed.source._replay) == sorted(waiting)
            for p in ended:  # the same rows, token for token, versions and rewards
                assert ([t.state.session.state() for t in kept[p].agents.trajectories]
                        == [t.state.session.state() for t in before[p].agents.trajectories])
                assert ([t.outcome for t in kept[p].agents.trajectories]
                        == [t.outcome for t in before[p].agents.trajectories])
            _, m = resumed.step(state, 1)
            assert float(m["agent/failed"]) == 0 and float(m["agent/calls"]) == 3
            assert len(resumed.source.groups) == 4 and not resumed.source._replay
            resumed.close()
    finally:
        rl_agents.HOLD.set()

"""Agents as rollouts (`env=agent`): OpenAI-API agent code trains through the gateway
exactly as the same task as an in-process `Environment` does; rewritten histories fork;
agent programs join by command line; and a battery of bad agents each end their own
trajectory with its reason while the run goes on."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.train.loop import train

pytestmark = pytest.mark.e2e

TESTS = Path(__file__).parent


def _config(tmp_path: Path, run: str, env: dict, data: dict | None = None, steps: int = 2,
            batch: int = 4, g: int = 2, **train_fields):
    return make_config(
        algo={"name": "grpo", "num_generations": g}, model=dict(TINY_MODEL, tokenizer="bytes"),
        data=data or {"name": "arithmetic", "num_train": 16, "num_eval": 0, "max_len": 64},
        optim={"lr": 1e-2, "warmup_steps": 0, "decay": "constant"},
        train={"steps": steps, "batch_size": batch, "eval_every": 0, "checkpoint_every": 0,
               **train_fields},
        rollout={"max_new_tokens": 6}, logger={"progress": False},
        env={"max_turns": 3, "max_tokens": 64, "stop": ["\\n"], **env},
        run={"dir": str(tmp_path / run)})


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_gateway_trajectories_train_exactly_as_the_environment_does(tmp_path):
    """The same task, an in-process `Environment` (rl_envs:PrintableGame) and an agent that
    plays it through the text completions API (rl_agents:printable), same seeds, fp32: the
    same tokens are sampled and fed (token-exact sessions, one sampling stream per
    trajectory), so rewards, losses and gradients agree to the bit."""
    env = train(_config(tmp_path, "env", {"name": "rl_envs:PrintableGame"}))
    agent = train(_config(tmp_path, "agent", {"name": "agent", "agent": "rl_agents:printable",
                                              "agent_rows": 1}))
    a, b = _steps(tmp_path / "env"), _steps(tmp_path / "agent")
    assert len(a) == len(b) == 2 and env["step"] == agent["step"] == 2
    keys = ("reward/mean", "reward/std", "loss", "grad_norm", "env/turns", "completion/length",
            "env/observation_tokens", "mismatch/logprob_abs_max")
    for x, y in zip(a, b):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}
        assert y["agent/failed"] == 0 and y["agent/calls"] == 3 and y["agent/forks"] == 0
    assert len({x["reward/mean"] for x in a}) == 2 and a[0]["grad_norm"] > 0  # not a constant


def test_a_rewritten_history_forks_into_rows_that_share_the_reward(tmp_path):
    """An agent that edits its earlier answer before its second call: the call does not
    extend the row, so the trajectory takes its second row (agent/forks = 1); both rows
    train (the model's tokens of each), and the group's advantages count the trajectory
    once (`group_advantages` over trajectories)."""
    train(_config(tmp_path, "fork", {"name": "agent", "agent": "rl_agents:rewrites",
                                     "agent_rows": 2}, steps=1))
    step = _steps(tmp_path / "fork")[0]
    assert step["agent/forks"] == 1.0 and step["agent/calls"] == 2 and step["agent/failed"] == 0
    # two rows per trajectory, each holding model tokens: twice one call's on average
    assert step["env/model_tokens"] > 0 and step["agent/rows_dropped"] == 0


def test_an_agent_program_plays_each_trajectory(tmp_path):
    """env.agent_command: a program per trajectory, the session's URL and key and the row in
    its environment; its reward is the last line it prints."""
    program = f"{sys.executable} {TESTS / 'agent_program.py'}"
    train(_config(tmp_path, "program", {"name": "agent", "agent_command": program,
                                        "agent_rows": 1}, steps=1))
    step = _steps(tmp_path / "program")[0]
    assert step["agent/failed"] == 0 and step["agent/calls"] == 1
    assert 0 < step["reward/mean"] <= 1


def test_bad_agents_end_their_own_trajectories_and_the_run_goes_on(tmp_path):
    """One prompt per misbehaviour (rl_agents:misbehaving reads the row's `behaviour`): an
    agent that raises, sleeps forever, blocks its thread, calls past its cap, uses a wrong
    key or another session's id, sends malformed JSON, asks for a huge max_tokens or
    returns no reward. Each ends its own trajectory with env.error_reward and a counted
    reason (the huge max_tokens is served within the trajectory's room and scores); the
    run finishes, the well-behaved agent beside them scores (and the numbers it returns
    beside its reward are logged as agent/info/*), and the gateway stops with it."""
    behaviours = ["fine", "raises", "sleeps", "blocks", "calls_forever", "wrong_key",
                  "other_session", "malformed", "huge_max_tokens", "no_reward", "fine", "fine"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"task {i}:", "behaviour": b}) + "\n"
                            for i, b in enumerate(behaviours)))
    # 8 s: the agent calling forever reaches its cap of 3 calls first even when the suite's
    # other worker loads both cores (at 4 s it sometimes timed out instead)
    cfg = _config(tmp_path, "bad", {"name": "agent", "agent": "rl_agents:misbehaving",
                                    "agent_rows": 1, "agent_timeout_s": 8, "agent_max_calls": 3},
                  data={"name": "jsonl", "path": str(rows), "num_eval": 0, "max_len": 64},
                  steps=1, batch=len(behaviours), g=2)
    import rl_agents
    rl_agents.RELEASE.clear()
    try:
        train(cfg)
    finally:
        rl_agents.RELEASE.set()
    # the run's end stopped its gateway (the agents blocking their threads keep only those)
    assert not [t for t in threading.enumerate() if t.name == "gpurl-gateway" and t.is_alive()]
    step = _steps(tmp_path / "bad")[0]
    # two trajectories of each: raises, a wrong key, another session's id, malformed JSON
    assert step["agent/raised"] == 8
    assert step["agent/timeouts"] == 4  # sleeps forever, blocks its thread
    assert step["agent/over_limit"] == 2 and step["agent/no_reward"] == 2
    assert step["agent/failed"] == pytest.approx(16 / 24)
    assert np.isfinite(step["loss"]) and step["reward/mean"] > 0  # fine and huge_max_tokens
    # the numbers the fine agents returned beside their rewards, averaged over those agents
    # (not text, a bool or infinity)
    assert step["agent/info/tries"] == 1.0 and 0 <= step["agent/info/chars"] <= 12
    assert not {"agent/info/label", "agent/info/ok", "agent/info/inf"} & set(step)

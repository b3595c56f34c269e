"""Crash and resume with real processes: `gpurl train` stopped by SIGTERM (preemption: it
saves and exits 0) and by SIGKILL at any moment, also while a checkpoint is being
written, then rerun with the same command, ends with exactly the parameters and metrics
of an uninterrupted run (SFT and GRPO)."""

from __future__ import annotations

import pytest

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from conftest import xla_flags
from gpurl.train.restore import restore_run
from test_multiprocess import GRPO_ARGS

pytestmark = pytest.mark.e2e

TESTS = Path(__file__).parent
STEPS = 40
# SFT on the tiny model (the command line's defaults are the real-model GRPO job).
ARGS = ["algo=sft", "model=tiny", "data=arithmetic", "optim=adamw", "train=default",
        "rollout=default", "model.d_model=32", "model.mlp_dim=64", "model.head_dim=8", "model.dtype=float32",
        "data.num_train=200", "data.num_eval=0", "train.batch_size=8",
        "train.micro_batch_size=4", f"train.steps={STEPS}", "train.checkpoint_every=10",
        "train.keep_checkpoints=10", "optim.weight_decay=0.01", "logger.progress=false"]
GRPO_STEPS = 6
GRPO = [a for a in GRPO_ARGS
        if not a.startswith(("train.steps=", "train.checkpoint_every=", "data.num_eval="))] + [
    f"train.steps={GRPO_STEPS}", "train.checkpoint_every=2", "train.keep_checkpoints=5",
    "data.num_eval=0", "train.eval_pass_k=0"]


def _start(args: list[str], run_dir: Path, commits: Path | None = None) -> subprocess.Popen:
    """`gpurl train`; with `commits`, every checkpoint commit is held open (slow_commit.py)."""
    entry = [str(TESTS / "slow_commit.py")] if commits else ["-m", "gpurl.cli"]
    env = dict(os.environ, XLA_FLAGS=xla_flags(2),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    if commits:
        commits.mkdir(exist_ok=True)
        env.update(GPURL_TEST_COMMIT_DIR=str(commits), GPURL_TEST_COMMIT_DELAY_S="3")
    return subprocess.Popen([sys.executable, *entry, "train", *args, f"run.dir={run_dir}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen, ready: Callable[[], bool], what: str) -> None:
    deadline = time.time() + 300
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{proc.stdout.read()}")
        assert time.time() < deadline, f"no {what} within 300 s"
        time.sleep(0.01)


def _finished(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def _temporary(run_dir: Path) -> list[str]:
    return [p.name for p in (run_dir / "checkpoints").iterdir() if "tmp" in p.name]


def _sigterm_after(args: list[str], run_dir: Path, step: int) -> int:
    """Sends SIGTERM once checkpoint `step` is complete; returns the step it saved at."""
    proc = _start(args, run_dir)
    _wait(proc, lambda: (run_dir / "checkpoints" / str(step)).is_dir(), f"checkpoint {step}")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    saved = max(_finished(run_dir))
    assert f"SIGTERM: saved a checkpoint at step {saved}; rerun to resume." in out
    assert not (run_dir / "summary.json").exists()
    return saved


def _kill_mid_save(args: list[str], run_dir: Path, after: int, committing: bool) -> None:
    """SIGKILL while the first checkpoint past `after` is written: as soon as its temporary
    directory appears (arrays half written) or, with `committing`, once every array is on
    disk but before the commit. The finished checkpoints must stay as they were."""
    commits = run_dir.parent / f"commits-{run_dir.name}"
    proc = _start(args, run_dir, commits)
    before = _finished(run_dir)

    def saving() -> bool:
        names = [p.name for p in commits.iterdir()] if committing else _temporary(run_dir)
        return any(n.split(".")[0].isdigit() and int(n.split(".")[0]) > after for n in names)

    _wait(proc, saving, "checkpoint being written")
    proc.kill()
    out, _ = proc.communicate(timeout=60)
    assert f"resuming from step {after}" in out, out
    assert _finished(run_dir) == before and _temporary(run_dir), (_finished(run_dir), out)
    assert not (run_dir / "summary.json").exists()


def _run_through(args: list[str], run_dir: Path, proc: subprocess.Popen | None = None) -> str:
    proc = proc or _start(args, run_dir)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    return out


def _rerun(args: list[str], run_dir: Path, resumed_at: int) -> None:
    out = _run_through(args, run_dir)
    assert f"resuming from step {resumed_at}," in out
    assert _temporary(run_dir) == []  # the cut-short save was cleaned up


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_params(a_dir: Path, b_dir: Path) -> None:
    (_, a), (_, b) = restore_run(a_dir), restore_run(b_dir)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_sft_sigterm_and_kills_mid_save_resume_exactly(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    uninterrupted = _start(ARGS, straight)  # alongside the interrupted runs
    saved = _sigterm_after(ARGS, crashed, 10)
    _kill_mid_save(ARGS, crashed, saved, committing=False)
    _kill_mid_save(ARGS, crashed, saved, committing=True)
    _rerun(ARGS, crashed, resumed_at=saved)
    _run_through(ARGS, straight, uninterrupted)

    _assert_same_params(straight, crashed)
    rows = _metrics(crashed)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # nothing logged twice
    assert [r["loss"] for r in rows] == [r["loss"] for r in _metrics(straight)]


def test_grpo_sigterm_and_kill_mid_save_resume_exactly(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    uninterrupted = _start(GRPO, straight)
    saved = _sigterm_after(GRPO, crashed, 2)
    _kill_mid_save(GRPO, crashed, saved, committing=True)
    _rerun(GRPO, crashed, resumed_at=saved)
    _run_through(GRPO, straight, uninterrupted)

    _assert_same_params(straight, crashed)
    keys = ("reward/mean", "loss", "kl", "grad_norm")
    a = [{k: r[k] for k in keys} for r in _metrics(straight) if "loss" in r]
    b = [{k: r[k] for k in keys} for r in _metrics(crashed) if "loss" in r]
    assert len(a) == GRPO_STEPS and a == b


# Continuous rollouts with the deterministic swap schedule (`rollout.swap_chunks`)
CONTINUOUS = GRPO + ["mesh.placement=split", "mesh.rollout_devices=1", "rollout.mode=continuous",
                     "rollout.swap_chunks=2", "rollout.max_lag=2", "rollout.in_flight=2",
                     "rollout.decode_chunk=2"]


# ... and with multi-turn trajectories under dynamic sampling: guess the number, up to 3 turns,
# games with an even answer scoring 1.0 on every row (dropped and replaced from the stream);
# the environments in flight at the checkpoint are built again and replayed with the turns
# they were given
AGENTIC = ([a for a in CONTINUOUS if not a.startswith(("data=", "data.max_len=",
                                                       "rollout.max_new_tokens=", "rewards="))]
           + ["data=guess_number", "data.max_len=256", "data.few_shot=1", "env=guess_number",
              "env.max_turns=3", "env.max_tokens=32", "rollout.max_new_tokens=4",
              "rewards=[rl_rewards:printable_on_odd_answers]",
              "algo.dynamic_sampling=true", "algo.max_refills=3"])


def _killed_at_checkpoint_2_and_resumed(args, tmp_path):
    """An uninterrupted run and one killed (SIGKILL) once checkpoint 2 is written and rerun
    to the end, with equal parameters: their run directories."""
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    uninterrupted = _start(args, straight)
    proc = _start(args, crashed)
    _wait(proc, lambda: (crashed / "checkpoints" / "2").is_dir(), "checkpoint 2")
    proc.kill()
    proc.communicate(timeout=60)
    saved = max(_finished(crashed))
    assert saved < GRPO_STEPS
    _rerun(args, crashed, resumed_at=saved)
    _run_through(args, straight, uninterrupted)
    _assert_same_params(straight, crashed)
    return straight, crashed


@pytest.mark.parametrize("args", [CONTINUOUS, AGENTIC], ids=["continuous", "env_dynamic_sampling"])
def test_continuous_kill_and_resume_equal_an_uninterrupted_run(tmp_path, args):
    """Continuous mode killed (SIGKILL) after its first checkpoint: the checkpoint holds the
    requests in flight (tokens, versions, sampling offsets), the groups and their order,
    so the rerun samples, trains and logs exactly what the uninterrupted run does; also
    for multi-turn trajectories under dynamic sampling (a step's refill rounds end within
    it; the environments in flight are replayed)."""
    straight, crashed = _killed_at_checkpoint_2_and_resumed(args, tmp_path)
    keys = ("reward/mean", "loss", "grad_norm", "off_policy/lag", "off_policy/weight_mean",
            "rollout/restarted", "rollout/rounds", "groups/kept", "rollout/prefix_hit_rate")
    a = [{k: r[k] for k in keys} for r in _metrics(straight) if "loss" in r]
    b = [{k: r[k] for k in keys} for r in _metrics(crashed) if "loss" in r]
    assert len(a) == GRPO_STEPS and a == b
    assert any(r["off_policy/lag"] > 0 for r in a)
    assert any(r["rollout/rounds"] > 1 for r in a) == (args is AGENTIC)  # groups replaced
    if args is AGENTIC:
        assert [r["env/turns"] for r in _metrics(straight) if "loss" in r] == [
            r["env/turns"] for r in _metrics(crashed) if "loss" in r]
        assert any(r["env/turns"] > 1 for r in _metrics(straight) if "loss" in r)


# OpenAI-API agents through the gateway (rl_agents:printable), a checkpoint every 2 steps
AGENTS = [a for a in GRPO if not a.startswith(("rollout.max_new_tokens=", "rewards="))] + [
    "rollout.max_new_tokens=6", "env=agent", "env.agent=rl_agents:printable",
    "env.agent_rows=1", "env.max_turns=3", "env.max_tokens=64", "env.stop=[\\n]"]


def test_an_agent_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_run(tmp_path):
    """SIGKILL of a run whose trajectories agents play through the gateway: a step's agents
    run within the step, so the checkpoint holds no trajectory in flight, and the rerun
    plays the next step's agents again from its start (their calls draw from the same
    sampling streams): the parameters and metrics of the uninterrupted run."""
    straight, crashed = _killed_at_checkpoint_2_and_resumed(AGENTS, tmp_path)
    keys = ("reward/mean", "loss", "grad_norm", "agent/calls", "env/observation_tokens")
    a = [{k: r[k] for k in keys} for r in _metrics(straight) if "loss" in r]
    b = [{k: r[k] for k in keys} for r in _metrics(crashed) if "loss" in r]
    assert len(a) == GRPO_STEPS and a == b

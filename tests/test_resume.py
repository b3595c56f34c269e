"""Crash and resume with real processes: `gpurl train` stopped by SIGTERM (graceful) and
by SIGKILL (a crash), rerun with the same command, ends with exactly the parameters of
an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from gpurl.config import MeshConfig
from gpurl.distributed.mesh import trainer_mesh
from gpurl.models import model_spec
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.optim import make_optimizer
from conftest import make_config

STEPS = 60
# SFT on the tiny model (the command line's defaults are the real-model GRPO job).
ARGS = ["algo=sft", "model=tiny", "data=arithmetic", "optim=adamw", "train=default",
        "rollout=default", "model.d_model=32", "model.mlp_dim=64", "model.head_dim=8", "model.dtype=float32",
        "data.num_train=200", "data.num_eval=0", "train.batch_size=8",
        "train.micro_batch_size=4", f"train.steps={STEPS}", "train.checkpoint_every=10",
        "train.keep_checkpoints=10", "optim.weight_decay=0.01"]


def _cmd(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "gpurl.cli", "train", *ARGS, f"run.dir={run_dir}"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    return env


def _run_until_checkpoint(run_dir: Path, sig: int) -> subprocess.CompletedProcess:
    """Starts a run, sends `sig` as soon as its first checkpoint is complete."""
    proc = subprocess.Popen(_cmd(run_dir), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "10").is_dir():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def _final_params(run_dir: Path):
    cfg = make_config(model={"d_model": 32, "mlp_dim": 64, "head_dim": 8, "vocab_size": 259,
                             "dtype": "float32"})
    spec = model_spec(cfg.model)
    optimizer = make_optimizer(cfg.optim, STEPS)
    from gpurl.train.step import placement
    place = placement(spec, optimizer, trainer_mesh(MeshConfig(data=1), jax.devices()[:1]),
                      cfg.mesh.train_rules)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=10)
    assert ckpt.latest_step() == STEPS
    state, meta = ckpt.restore(STEPS, place.abstract_state, place.state)
    assert meta["step"] == STEPS and meta["examples_seen"] == STEPS * 8
    return jax.device_get(state)


def test_kill_and_rerun_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    done = subprocess.run(_cmd(straight), env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr

    crashed = tmp_path / "crashed"
    term = _run_until_checkpoint(crashed, signal.SIGTERM)
    assert term.returncode == 143, term.stdout
    assert "SIGTERM: saved a checkpoint" in term.stdout
    assert not (crashed / "summary.json").exists()

    # Second interruption: a hard crash after the next checkpoint.
    proc = subprocess.Popen(_cmd(crashed), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    first = max(int(p.name) for p in (crashed / "checkpoints").iterdir() if p.name.isdigit())
    while not any(p.name.isdigit() and int(p.name) > first
                  for p in (crashed / "checkpoints").iterdir()):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.01)
    proc.kill()
    out, _ = proc.communicate(timeout=60)
    assert f"resuming from step {first}" in out
    assert not (crashed / "summary.json").exists()

    final = subprocess.run(_cmd(crashed), env=_env(), capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    assert "resuming from step" in final.stderr
    resumed_at = int(final.stderr.split("resuming from step ")[1].split(",")[0])
    assert 0 < resumed_at < STEPS

    a, b = _final_params(straight), _final_params(crashed)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    steps = [int(line.split('"step": ')[1].split(",")[0])
             for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # rows after the checkpoint were not duplicated

"""Real `jax.distributed` processes: 2 processes x 2 devices train exactly like
1 process x 4 devices (each process loads only its own rows of every batch)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import xla_flags

pytestmark = pytest.mark.multiprocess

# SFT on the tiny model (the command line's defaults are the real-model GRPO job).
ARGS = ["algo=sft", "model=tiny", "data=arithmetic", "optim=adamw", "train=default",
        "rollout=default", "model.d_model=32", "model.mlp_dim=64", "model.head_dim=8", "model.dtype=float32",
        "data.num_train=200", "data.num_eval=16", "train.batch_size=8", "train.steps=6",
        "train.eval_every=3", "train.eval_batch_size=8", "train.checkpoint_every=3",
        "logger.progress=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run_dir: Path, processes: int, args: list[str] = ARGS,
            env_extra: dict[str, str] | None = None) -> list[subprocess.Popen]:
    env = dict(os.environ, XLA_FLAGS=xla_flags(4 // processes),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),  # reward functions
                                           os.environ.get("PYTHONPATH", "")]),
               **(env_extra or {}), **_compile_env(processes))
    extra = []
    port = _free_port()
    procs = []
    for i in range(processes):
        if processes > 1:
            extra = [f"distributed.coordinator=127.0.0.1:{port}",
                     f"distributed.num_processes={processes}", f"distributed.process_id={i}",
                     *PATIENT]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gpurl.cli", "train", *args, f"run.dir={run_dir}", *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


# Runs that compare figures wait 120 s for a silent peer, not the default 30 s: CI runs up to
# nine such processes at once on 2 cores, and one stall past 30 s stopped a run that was
# healthy (stop 57: every process "stopped sending heartbeats" at the same moment). The test
# of the timeout itself keeps the default.
PATIENT = ["distributed.heartbeat_timeout_s=120"]


def _compile_env(processes: int) -> dict[str, str]:
    """Multi-process runs compile every program themselves, without the session's
    compilation cache: with it, process 0 could load a program that another run had just
    written while process 1 still compiled it, and gloo gives up on a peer that reaches a
    collective 30 s late (tests run several runs at once on 2 cores)."""
    return {"JAX_ENABLE_COMPILATION_CACHE": "false"} if processes > 1 else {}


def _figures(record: dict) -> dict:
    """A metrics record without what depends on the clock or the allocator."""
    return {k: v for k, v in record.items()
            if not (k.startswith("time/") or k.endswith(("_per_s", "_s", "_gb", "_mfu", "/mfu")))}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_and_two(tmp_path: Path, args: list[str], timeout: float = 400) -> tuple[list, list]:
    """The metrics rows of 1 process x 4 devices and of 2 x 2 on `args`, both run to the end."""
    procs = _launch(tmp_path / "one", 1, args) + _launch(tmp_path / "two", 2, args)
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    return _metrics(tmp_path / "one"), _metrics(tmp_path / "two")


def test_two_processes_match_one_process(tmp_path):
    procs = _launch(tmp_path / "one", 1) + _launch(tmp_path / "two", 2)
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    assert "process 1/2" in outputs[2] and "global_devices=4" in outputs[2]
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two]  # process 0 alone wrote rows
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "eval/loss", "eval/token_accuracy"):
            if key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-5, err_msg=key)
    assert sorted(p.name for p in (tmp_path / "two/checkpoints").iterdir()) == ["3", "6"]
    summary = json.loads((tmp_path / "two/summary.json").read_text())
    assert summary["step"] == 6 and "eval/loss" in summary


# GRPO on the tiny model; every group is set because the defaults are the real-model job.
TINY_GRPO_ARGS = ["algo=grpo", "model=tiny", "model.tokenizer=bytes", "data=arithmetic",
                  "data.num_train=64", "data.num_eval=8", "data.max_len=16", "optim=adamw",
                  "optim.lr=1e-2", "optim.warmup_steps=0", "optim.decay=constant",
                  "train=default", "train.steps=3", "train.batch_size=4", "train.eval_every=0",
                  "train.checkpoint_every=0", "train.eval_batch_size=16", "train.eval_pass_k=2",
                  "rollout=default", "rollout.max_new_tokens=8", "algo.num_generations=4",
                  "logger.progress=false"]
GRPO_ARGS = TINY_GRPO_ARGS + ["algo.beta=0.04", "rewards=[rl_rewards:printable_counted]"]


def test_grpo_two_processes_match_one_and_score_each_row_once(tmp_path):
    """GRPO with 2 processes x 2 devices, colocated and split (each process gives one
    device to rollout, one to training, and weights sync every step), gives the rewards
    and losses of 1 process x 4 devices; rewards are computed per shard, so the rows
    scored across all processes add up to exactly the rows generated (3 steps x 4 prompts
    x 4 samples, and two evals of 8 greedy + 8 x 2 sampled rows)."""
    runs = {"one": (1, []), "two": (2, []),
            "split": (2, ["mesh.placement=split", "mesh.rollout_devices=2"])}
    procs = []
    for name, (n, extra_args) in runs.items():
        (tmp_path / f"count-{name}").mkdir()
        procs += _launch(tmp_path / name, n, GRPO_ARGS + extra_args,
                         {"GPURL_TEST_COUNT_DIR": str(tmp_path / f"count-{name}")})
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    one = _metrics(tmp_path / "one")
    assert [r["step"] for r in one] == [0, 1, 2, 3, 3]
    for name in ("two", "split"):
        other = _metrics(tmp_path / name)
        assert [r["step"] for r in other] == [r["step"] for r in one]  # written once
        for a, b in zip(one, other):
            for key in ("reward/mean", "loss", "kl", "grad_norm", "eval/accuracy", "eval/pass@2"):
                if key in a:
                    np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7,
                                               err_msg=f"{name}: {key}")
    assert all("time/sync_s" in r for r in _metrics(tmp_path / "split") if "loss" in r)
    expected = 3 * 4 * 4 + 2 * (8 + 8 * 2)
    for name, (n, _) in runs.items():
        per_process = {f.name: sum(int(x) for x in f.read_text().split())
                       for f in (tmp_path / f"count-{name}").iterdir()}
        assert len(per_process) == n
        assert sum(per_process.values()) == expected, (name, per_process)


def test_rows_split_within_a_row_across_two_processes_match_one_process(tmp_path):
    """GRPO whose packed rows are split over a context axis of 4 devices, 2 on each of 2
    processes (keys and values gathered across them every layer), and GRPO with a tensor
    axis of 4 across them, train like 1 process x 4 devices with one device per row. Each
    process then needs the other's rows: before they were gathered (`host.to_device`),
    each took its own rows for all of them (grad_norm 0.74 and 0.22 against 0.46, sampler
    log-probs 10 nats off)."""
    runs = {"one": (1, []), "context": (2, ["mesh.data=1", "mesh.context=4"]),
            "tp": (2, ["mesh.data=1", "mesh.tp=4"])}
    procs = [p for name, (n, extra) in runs.items()
             for p in _launch(tmp_path / name, n, GRPO_ARGS + extra)]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    assert "'context': 4" in outputs[1]
    one = _metrics(tmp_path / "one")
    for name in ("context", "tp"):
        other = _metrics(tmp_path / name)
        assert [r["step"] for r in one] == [r["step"] for r in other]
        for a, b in zip(one, other):
            for key in ("reward/mean", "loss", "kl", "grad_norm", "mismatch/logprob_abs_max"):
                # the sampler/trainer gap is float32 rounding (~1e-6) on both sides, so two
                # layouts differ by as much (the defect it shows was 10 nats)
                atol = 1e-5 if key.startswith("mismatch/") else 1e-6
                if key in a:
                    np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=atol,
                                               err_msg=f"{name}: {key}")


def test_continuous_rollouts_over_two_processes_take_each_version_together(tmp_path):
    """Continuous mode with 2 processes x 2 devices (each process: one rollout device, one
    trainer device) and the deterministic swap schedule: every step's weights reach both
    processes' engines by the step's batch (rollout/version = step), no trained token is
    older than rollout.max_lag, every trained row is scored once where it lives, and a
    second run reproduces the first's figures exactly."""
    args = GRPO_ARGS + ["mesh.placement=split", "mesh.rollout_devices=2", "rollout.mode=continuous",
                        "rollout.swap_chunks=2", "rollout.max_lag=1", "rollout.in_flight=1",
                        "rollout.decode_chunk=2"]
    procs = []
    for name in ("a", "b"):
        (tmp_path / f"count-{name}").mkdir()
        procs += _launch(tmp_path / name, 2, args,
                         {"GPURL_TEST_COUNT_DIR": str(tmp_path / f"count-{name}")})
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    trained = [r for r in a if "loss" in r]
    assert [r["rollout/version"] for r in trained] == [0.0, 1.0, 2.0]
    assert all(r["off_policy/lag_max"] <= 1 and "mismatch/logprob_abs_max" in r for r in trained)
    for x, y in zip(a, b):  # all but times, rates and memory
        assert _figures(x) == _figures(y)
    counted = sum(int(x) for f in (tmp_path / "count-a").iterdir() for x in f.read_text().split())
    assert counted == 3 * 4 * 4 + 2 * (8 + 8 * 2)


def test_the_engine_agrees_once_per_scheduling_iteration(tmp_path):
    """A rollout engine over 2 processes x 2 devices, each process with its own requests
    of mixed lengths (different schedules), makes one host gather per scheduling iteration
    plus one at the call's start (it made up to 11 per iteration), and generates what
    1 process x 4 devices does (tokens equal, log-probs to float32 rounding)."""
    worker = Path(__file__).parent / "engine_worker.py"
    env = dict(os.environ, XLA_FLAGS=xla_flags(4))
    one = subprocess.Popen([sys.executable, str(worker), str(tmp_path / "one.json")], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    env = dict(env, XLA_FLAGS=xla_flags(2), **_compile_env(2))
    port = _free_port()
    two = [subprocess.Popen([sys.executable, str(worker), str(tmp_path / f"two{i}.json"),
                             f"127.0.0.1:{port}", "2", str(i)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
    for p in [one, *two]:
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 0, out
    alone = json.loads((tmp_path / "one.json").read_text())
    parts = [json.loads((tmp_path / f"two{i}.json").read_text()) for i in range(2)]
    for part in parts:
        assert part["chunks"] >= 3
        assert part["gathers"] == part["iterations"] + 1, part
    assert parts[0]["iterations"] == parts[1]["iterations"]
    assert alone["tokens"] == parts[0]["tokens"] + parts[1]["tokens"]
    for a, b in zip(alone["logprobs"], parts[0]["logprobs"] + parts[1]["logprobs"]):
        np.testing.assert_allclose(a, b, atol=1e-5)


# GRPO with the guess-the-number environment (its own data and rollout presets); each
# environment appends "<trajectory> <turn>" to the count directory as it is stepped
ENV_ARGS = ([a for a in TINY_GRPO_ARGS if not a.startswith(("data=", "data.max_len", "rollout"))]
            + ["env=guess_number", "env.name=rl_envs:CountedGuess", "env.max_turns=3",
               "env.max_tokens=40", "data.max_len=256", "data.few_shot=1",
               "rollout.max_new_tokens=4", "train.steps=2", "data.num_eval=0"])


def test_environments_are_stepped_once_per_turn_where_their_rows_live(tmp_path):
    """Multi-turn GRPO with 2 processes x 2 devices equals 1 process x 4 devices, and
    every trajectory's environment is stepped by one process, exactly once per turn
    (turns 1, 2, ... with none repeated or skipped), for every row generated: 2 steps x
    4 prompts x 4 samples."""
    procs = []
    for name, n in (("one", 1), ("two", 2)):
        (tmp_path / f"count-{name}").mkdir()
        procs += _launch(tmp_path / name, n, ENV_ARGS,
                         {"GPURL_TEST_COUNT_DIR": str(tmp_path / f"count-{name}")})
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        for key in ("reward/mean", "env/turns", "env/observation_tokens", "loss", "grad_norm"):
            if key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert "env/turns" in one[0]
    steps = {}
    for name, n in (("one", 1), ("two", 2)):
        files = list((tmp_path / f"count-{name}").iterdir())
        assert len(files) == n
        turns: dict[str, list[int]] = {}
        for f in files:
            for line in f.read_text().split("\n"):
                if line:
                    traj, turn = line.split()
                    turns.setdefault(traj, []).append(int(turn))
        assert len(turns) == 2 * 4 * 4, name
        assert all(t == list(range(1, len(t) + 1)) for t in turns.values()), name
        if n == 2:  # both processes stepped their own rows
            assert all(f.stat().st_size for f in files)
        steps[name] = sorted(len(t) for t in turns.values())
    assert steps["one"] == steps["two"]


# the tiny mixture-of-experts model with its experts split over 2 devices (the trainer's
# expert axis spans both processes' devices in the 2-process run), routing replay on
MOE_ARGS = ([a for a in GRPO_ARGS if not a.startswith("model=")]
            + ["model=tiny_moe", "model.moe.replay_routing=true", "mesh.data=2", "mesh.expert=2",
               "model.moe.aux_loss_coef=0.01", "model.moe.z_loss_coef=0.001", "data.num_eval=0"])


def test_moe_grpo_two_processes_match_one(tmp_path):
    one, two = _one_and_two(tmp_path, MOE_ARGS)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        for key in ("reward/mean", "loss", "grad_norm", "moe/aux_loss", "moe/z_loss",
                    "moe/load_max", "moe/replay_flips"):
            if key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert any("moe/aux_loss" in r for r in one)


# PPO (critic with its own backbone, KL in the reward) and DPO (reference pass, pair
# batches, greedy task eval) on the tiny model.
PPO_ARGS = ([a for a in GRPO_ARGS if not a.startswith("algo")]
            + ["algo=ppo", "algo.num_generations=4", "algo.critic_lr=1e-2"])
DPO_ARGS = ["algo=dpo", "model=tiny", "model.tokenizer=bytes", "data=addition_prefs",
            "data.num_train=64", "data.num_eval=16", "data.few_shot=0", "data.max_len=32",
            "optim=adamw", "optim.lr=1e-2", "optim.warmup_steps=0", "train=default",
            "train.steps=3", "train.batch_size=8", "train.eval_every=0",
            "train.checkpoint_every=0", "train.eval_batch_size=16", "rollout=default",
            "rollout.max_new_tokens=4", "logger.progress=false"]


RM_ARGS = [a for a in DPO_ARGS if not a.startswith("algo")] + ["algo=rm"]


def test_ppo_dpo_and_rm_two_processes_match_one(tmp_path):
    """PPO, DPO and reward-model training with 2 processes x 2 devices give the losses,
    gradients, rewards and eval figures of 1 process x 4 devices."""
    procs = []
    for algo, args in (("ppo", PPO_ARGS), ("dpo", DPO_ARGS), ("rm", RM_ARGS)):
        for n in (1, 2):
            (tmp_path / f"count-{algo}{n}").mkdir()
            procs += _launch(tmp_path / f"{algo}{n}", n, args,
                             {"GPURL_TEST_COUNT_DIR": str(tmp_path / f"count-{algo}{n}")})
    outputs = [p.communicate(timeout=500)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    keys = {"ppo": ("reward/mean", "loss", "policy_loss", "value_loss", "kl/rollout", "grad_norm",
                    "eval/accuracy", "eval/pass@2"),
            "dpo": ("loss", "grad_norm", "rewards/accuracy", "rewards/margin", "eval/loss",
                    "eval/rewards/accuracy", "eval/accuracy"),
            "rm": ("loss", "grad_norm", "rewards/margin", "eval/loss", "eval/rewards/margin")}
    _runs_match(tmp_path, keys, steps=[0, 1, 2, 3, 3])


def _runs_match(tmp_path: Path, keys: dict[str, tuple[str, ...]], steps: list[int]) -> None:
    """Runs `<algo>1` (1 process) and `<algo>2` (2 processes) logged the same rows at
    `steps`, and every key of `keys[algo]` in them agrees (each key seen at least once)."""
    for algo, names in keys.items():
        one, two = _metrics(tmp_path / f"{algo}1"), _metrics(tmp_path / f"{algo}2")
        assert [r["step"] for r in one] == [r["step"] for r in two] == steps
        seen = set()
        for a, b in zip(one, two):
            for key in names:
                if key in a:
                    seen.add(key)
                    # atol: PPO's policy loss of whitened advantages at ratio 1 is ~0 (1e-7)
                    np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6,
                                               err_msg=f"{algo}: {key}")
        assert seen == set(names), (algo, seen)


def test_distillation_two_processes_match_one(tmp_path):
    """On-policy distillation (with task rewards beside the teacher's signal) and logit
    distillation from a deeper teacher, 2 processes x 2 devices against 1 x 4: each
    process computes the teacher's signal for its own rows, and the losses, divergences,
    gradients and eval figures agree."""
    from conftest import tiny_teacher

    teacher = tiny_teacher(tmp_path / "teacher", {"vocab_size": 259, "num_layers": 3,
                                                  "tokenizer": "bytes"}, seed=4)
    runs = {"opd": [a for a in TINY_GRPO_ARGS if not a.startswith("algo=")]
            + ["algo=opd", "algo.task_weight=0.5", f"algo.teacher={teacher}"],
            "kd": [a for a in ARGS if not a.startswith("algo=")]
            + ["algo=kd", f"algo.teacher={teacher}", "algo.ce_weight=0.2"]}
    procs = [p for algo, args in runs.items() for n in (1, 2)
             for p in _launch(tmp_path / f"{algo}{n}", n, args)]
    outputs = [p.communicate(timeout=500)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out
    keys = {"opd": ("reward/mean", "loss", "distill/reverse_kl", "grad_norm", "eval/accuracy"),
            "kd": ("loss", "distill/forward_kl", "nll", "grad_norm", "eval/loss",
                   "eval/distill/forward_kl")}
    _runs_match(tmp_path, {"opd": keys["opd"]}, steps=[0, 1, 2, 3, 3])
    _runs_match(tmp_path, {"kd": keys["kd"]}, steps=[1, 2, 3, 3, 4, 5, 6, 6])


def test_killed_process_stops_the_others_within_60s(tmp_path):
    """SIGKILL of one process mid-run: the other exits non-zero within 60 s (the
    coordination service's heartbeat timeout, distributed.heartbeat_timeout_s=30), no hang."""
    import signal
    import time

    port = _free_port()
    env = dict(os.environ, XLA_FLAGS=xla_flags(2),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent),
                                           os.environ.get("PYTHONPATH", "")]),
               **_compile_env(2))
    args = [a for a in GRPO_ARGS if not a.startswith("train.steps=")] + ["train.steps=500"]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "gpurl.cli", "train", *args, f"run.dir={tmp_path / 'run'}",
         f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
         f"distributed.process_id={i}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().count("reward/mean") >= 2):
        assert all(p.poll() is None for p in procs), procs[0].communicate()[0]
        assert time.time() < deadline, "the run never reached step 2"
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    try:
        procs[0].wait(timeout=60)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        raise AssertionError("process 0 still running 60 s after process 1 was killed")
    assert procs[0].returncode != 0
    assert time.time() - killed_at < 60


def test_sigterm_to_one_process_saves_one_checkpoint_and_all_exit_0(tmp_path):
    """Preemption reaches processes at different moments; SIGTERM to process 1 alone makes
    both processes stop after the same step, write that checkpoint together, and exit 0."""
    import signal
    import time

    port = _free_port()
    env = dict(os.environ, XLA_FLAGS=xla_flags(2),
               **_compile_env(2))
    args = [a for a in ARGS if not a.startswith(("train.steps=", "train.checkpoint_every=",
                                                 "train.eval_every="))]
    args += ["train.steps=500", "train.checkpoint_every=0", "train.eval_every=0", *PATIENT]
    run = tmp_path / "run"
    procs = [subprocess.Popen(
        [sys.executable, "-m", "gpurl.cli", "train", *args, f"run.dir={run}",
         f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
         f"distributed.process_id={i}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert all(p.poll() is None for p in procs), procs[0].communicate()[0]
        assert time.time() < deadline, "the run never reached step 3"
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    steps = [int(p.name) for p in (run / "checkpoints").iterdir()]
    assert len(steps) == 1 and 3 <= steps[0] < 500, steps
    assert f"SIGTERM: saved a checkpoint at step {steps[0]}" in outputs[0]
    assert not (run / "summary.json").exists()


# Two processes of one job, each with its own offline Hugging Face cache; prints the pin of a
# model id and the answers of a suite's rows, or the one sentence that stopped it.
PIN_SCRIPT = """
import json, sys
from gpurl.config import ConfigError, DistributedConfig
from gpurl.distributed import runtime
from gpurl.distributed.pins import agreed_pin
from gpurl.rollout.suites import load_rows
runtime.initialize(DistributedConfig(coordinator=sys.argv[1], num_processes=2,
                                     process_id=int(sys.argv[2])))
try:
    pin = agreed_pin("acme/tiny", "model.checkpoint")
    answers = [r["answer"] for r in load_rows(["math500"])["math500"]]
    print("RESULT" + json.dumps([pin, answers]))
except ConfigError as e:
    print("ERROR" + str(e))
"""


def test_every_process_reads_the_commit_process_0_resolves(tmp_path):
    """Hub ids resolve once for the job: a second host whose cache's refs/main is stale pins
    process 0's commit of a model and reads process 0's commit of a suite's dataset (before,
    it loaded its own: other weights and other rows under one config.yaml); a host whose
    cache lacks that commit stops the job with one sentence on every process."""
    from hub_server import Repo, commit_id, lay_out_cache

    old, new = ({"config.json": json.dumps({"v": v}).encode()} for v in (1, 2))
    rows = {v: {"test.jsonl": "".join(json.dumps({"problem": f"p{i}", "solution": "s",
                                                   "answer": f"{v}{i}"}) + "\n"
                                      for i in range(2)).encode()} for v in (1, 2)}
    both = Repo({commit_id(old): old, commit_id(new): new}, {"main": commit_id(new)})
    data = Repo({commit_id(rows[1]): rows[1], commit_id(rows[2]): rows[2]},
                {"main": commit_id(rows[2])})
    stale = (dataclasses.replace(both, refs={"main": commit_id(old)}),
             dataclasses.replace(data, refs={"main": commit_id(rows[1])}))
    lacking = (Repo({commit_id(old): old}, {"main": commit_id(old)}), stale[1])
    for host, (model, dataset) in {"h0": (both, data), "stale": stale, "lacking": lacking}.items():
        cache = tmp_path / host / "hub"
        lay_out_cache(cache, "model", "acme/tiny", model)
        lay_out_cache(cache, "dataset", "HuggingFaceH4/MATH-500", dataset)

    def job(second: str) -> list[str]:
        port = _free_port()
        procs = [subprocess.Popen(
            [sys.executable, "-c", PIN_SCRIPT, f"127.0.0.1:{port}", str(i)],
            env={**os.environ, "HF_HOME": str(tmp_path / home), "HF_HUB_OFFLINE": "1",
                 "XLA_FLAGS": xla_flags(1)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i, home in enumerate(("h0", second))]
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        return [next(ln for ln in out.splitlines() if ln.startswith(("RESULT", "ERROR")))
                for out in outs]

    agreed = job("stale")
    assert agreed[0] == agreed[1] == "RESULT" + json.dumps(
        [f"acme/tiny@{commit_id(new)}", ["20", "21"]]), agreed
    stopped = job("lacking")
    assert stopped[0] == stopped[1] and stopped[0].startswith(
        f"ERRORmodel.checkpoint=acme/tiny resolves to acme/tiny@{commit_id(new)} on process 0, "
        f"which process 1 cannot read ("), stopped
    assert stopped[0].endswith("give every process the same Hugging Face cache, or fetch "
                               f"acme/tiny@{commit_id(new)} into each host's cache.")


# OpenAI-API agents (rl_agents:printable) playing through each process's gateway
AGENT_ARGS = ([a for a in TINY_GRPO_ARGS if not a.startswith(("data.num_eval=", "rollout.max_new"))]
              + ["data.num_eval=0", "rollout.max_new_tokens=6", "env=agent",
                 "env.agent=rl_agents:printable", "env.agent_rows=1", "env.max_turns=3",
                 "env.max_tokens=64", "env.stop=[\\n]"])


def test_agents_on_two_processes_train_like_one(tmp_path):
    """Agents on both hosts, each process's gateway serving the sessions of the rows it
    holds, every process iterating its engine together until no agent is left: 2 processes
    x 2 devices give the rewards, losses and gradients of 1 process x 4 devices."""
    one, two = _one_and_two(tmp_path, AGENT_ARGS)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two):
        assert a["agent/calls"] == b["agent/calls"] == 3 and a["agent/failed"] == 0
        for key in ("reward/mean", "loss", "grad_norm", "env/observation_tokens"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=key)

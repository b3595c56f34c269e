"""Failures a user can cause end in one clear sentence or are survived on request:
non-finite losses (train.on_nonfinite), failing and hung reward functions
(rewards.on_error, rewards.timeout_s), bad inputs, and nothing in a config or a
checkpoint is ever run as code. See docs/reliability.md for the whole table."""

from __future__ import annotations

import dataclasses
import gc
import json
import pickle
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from conftest import TINY_MODEL, make_config, with_rewards
from gpurl.algorithms import registry
from gpurl.config import ConfigError, MeshConfig, ModelConfig
from gpurl.distributed.mesh import trainer_mesh
from gpurl.models import model_spec
from gpurl.rewards import RewardError, load, score_rows
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.loop import train
from gpurl.train.optim import make_optimizer
from gpurl.train.step import NonFiniteError, placement


def sft_config(run_dir: Path, steps: int = 4, **train_cfg):
    """Tiny SFT whose learning rate of 1e30 makes the second step's loss overflow."""
    return make_config(
        algo={"name": "sft"}, model=dict(TINY_MODEL, tokenizer="bytes"),
        data={"name": "arithmetic", "num_train": 32, "num_eval": 0},
        optim={"lr": 1e30, "warmup_steps": 0, "decay": "constant"},
        train={"steps": steps, "batch_size": 8, "checkpoint_every": 1, "keep_checkpoints": 10,
               "eval_every": 0, **train_cfg},
        logger={"progress": False}, run={"dir": str(run_dir)})


def restore_state(run_dir: Path, step: int):
    """The whole train state (parameters, optimizer, step, RNG) of a checkpoint."""
    cfg = registry.parse(yaml.safe_load((run_dir / "config.yaml").read_text()))
    spec, optimizer = model_spec(cfg.model), make_optimizer(cfg.optim, cfg.train.steps)
    place = placement(spec, optimizer, trainer_mesh(MeshConfig(data=1), jax.devices()[:1]),
                      cfg.mesh.train_rules)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=10)
    state, meta = ckpt.restore(step, place.abstract_state, place.state)
    ckpt.close()
    return jax.device_get(state), meta


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- non-finite loss


@pytest.mark.e2e
def test_nonfinite_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    with pytest.raises(NonFiniteError) as err:
        train(sft_config(tmp_path / "run"))
    message = str(err.value)
    # the 1e30 step overflows the gradient first: loss finite, gradient norm NaN
    assert message.startswith("step 2: the loss (5.557) or gradient norm (nan) is not finite")
    assert "\n" not in message
    assert f"{tmp_path / 'run' / 'checkpoints'} keeps the last good checkpoint (step 1)" in message
    assert "train.on_nonfinite=skip" in message
    assert Checkpointer(tmp_path / "run" / "checkpoints", 10).all_steps() == [1]


@pytest.mark.e2e
def test_nonfinite_skip_leaves_parameters_and_optimizer_unchanged(tmp_path):
    run = tmp_path / "run"
    summary = train(sft_config(run, on_nonfinite="skip"))
    assert summary["finished"]
    rows = [r for r in metrics(run) if "loss" in r]
    assert [r["nonfinite_skipped"] for r in rows] == [0, 1, 2, 3]
    good, _ = restore_state(run, 1)
    last, meta = restore_state(run, 4)
    assert meta["nonfinite_skipped"] == 3 and int(last.step) == 4
    for a, b in zip(jax.tree.leaves((good.params, good.opt_state)),
                    jax.tree.leaves((last.params, last.opt_state)), strict=True):
        np.testing.assert_array_equal(a, b)


def nan_reward(prompts, completions, **_):
    return [float("nan")] * len(completions)


@pytest.mark.e2e
def test_a_nan_reward_stops_grpo_at_its_first_step(tmp_path):
    from test_grpo import grpo_config

    cfg = grpo_config(tmp_path, "grpo", steps=3)
    cfg = dataclasses.replace(with_rewards(cfg, "test_reliability:nan_reward"),
                              data=dataclasses.replace(cfg.data, num_eval=0))
    with pytest.raises(NonFiniteError,
                       match=r"^step 1: the loss \(nan\) .*and no checkpoint was written"):
        train(cfg)


# ---------------------------------------------------------------- reward functions


def fails_on_odd_lengths(prompts, completions, **_):
    return [1 / (len(c) % 2 == 0) for c in completions]


def too_few(prompts, completions, **_):
    return [1.0]


def hangs(prompts, completions, **_):
    time.sleep(30)
    return [1.0] * len(completions)


def test_rewards_on_error_zero_scores_the_failing_rows_zero():
    completions = ["ab", "a", "cd", "abc", ""]
    stop = load(["test_reliability:fails_on_odd_lengths"])
    with pytest.raises(RewardError, match=r"'test_reliability:fails_on_odd_lengths' raised "
                                          r"ZeroDivisionError: .* on row 11; fix the function"):
        score_rows(stop, ["p"] * 5, completions, {}, first_row=10)
    zero = load(["test_reliability:fails_on_odd_lengths", "length_penalty"], on_error="zero")
    scores = score_rows(zero, ["p"] * 5, completions, {})
    np.testing.assert_array_equal(scores.parts["test_reliability:fails_on_odd_lengths"],
                                  [1, 0, 1, 0, 1])
    np.testing.assert_array_equal(scores.errors, [False, True, False, True, False])
    # the other function still scores every row
    np.testing.assert_allclose(scores.parts["length_penalty"], [-0.002, -0.001, -0.002, -0.003, 0])
    def two_rows(name: str):
        return score_rows(load([name], on_error="zero"), ["p"] * 2, ["a", "b"], {})

    scores = two_rows("test_reliability:too_few")
    assert scores.errors.all() and not scores.total.any()
    scores = two_rows("test_reliability:nan_reward")
    assert not scores.errors.any()  # NaN is a value, not an error: train.on_nonfinite handles it
    with pytest.raises(ConfigError, match="rewards.on_error='skip' is not valid"):
        load(["length_penalty"], on_error="skip")


def test_a_hung_reward_function_times_out():
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"^reward function 'test_reliability:hangs' did not "
                                          r"return within rewards.timeout_s=0.2 s on rows 4..6; "):
        score_rows(load(["test_reliability:hangs"], timeout_s=0.2), ["p"] * 3, ["a"] * 3, {},
                   first_row=4)
    zero = load(["test_reliability:hangs", "length_penalty"], on_error="zero", timeout_s=0.2)
    scores = score_rows(zero, ["p"] * 3, ["a"] * 3, {})
    assert scores.errors.all() and (scores.parts["test_reliability:hangs"] == 0).all()
    assert time.perf_counter() - start < 2  # two timeouts, not two hung calls


@pytest.mark.e2e
def test_grpo_with_rewards_on_error_zero_counts_the_failed_rows(tmp_path):
    from test_grpo import grpo_config

    cfg = grpo_config(tmp_path, "grpo", steps=2)
    cfg = dataclasses.replace(with_rewards(cfg, "test_reliability:fails_on_odd_lengths",
                                           "test_grpo:printable", on_error="zero"),
                              data=dataclasses.replace(cfg.data, num_eval=0))
    assert train(cfg)["finished"]
    rows = [r for r in metrics(tmp_path / "grpo") if "loss" in r]
    assert len(rows) == 2 and all("reward/errors" in r for r in rows)
    assert all(0 < r["reward/errors"] < 16 for r in rows)  # of 4 prompts x 4 completions


# ---------------------------------------------------------------- preemption


@pytest.mark.e2e
def test_sigterm_before_the_first_step_exits_cleanly_without_a_checkpoint(tmp_path, monkeypatch):
    import os
    import signal

    import gpurl.train.loop as loop

    real_build = loop._build

    def build_then_sigterm(cfg):  # the signal arrives while the model is being built
        built = real_build(cfg)
        os.kill(os.getpid(), signal.SIGTERM)
        return built

    monkeypatch.setattr(loop, "_build", build_then_sigterm)
    cfg = sft_config(tmp_path / "run")
    handler = signal.getsignal(signal.SIGTERM)
    summary = train(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e-3)))
    assert summary == {"step": 0, "finished": False}
    assert Checkpointer(tmp_path / "run" / "checkpoints", 10).all_steps() == []
    assert signal.getsignal(signal.SIGTERM) is handler  # the caller's handler is back


# ---------------------------------------------------------------- bad inputs


def test_mesh_sizes_that_do_not_fit_the_devices():
    with pytest.raises(ConfigError, match=r"mesh.data\*mesh.fsdp\*mesh.context\*mesh.expert\*mesh.tp = 6 "
                                          r"but there are 4 devices; choose sizes whose product is 4"):
        trainer_mesh(MeshConfig(data=3, fsdp=2), jax.devices())
    with pytest.raises(ConfigError, match=r"mesh sizes data=-1 fsdp=3 context=auto expert=1 tp=1 do not "
                                          r"fit 4 devices"):
        trainer_mesh(MeshConfig(data=-1, fsdp=3), jax.devices())


@pytest.mark.e2e
def test_an_unreachable_coordinator_is_one_sentence_after_the_timeout(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "gpurl.cli", "train", "algo=sft", "model=tiny", "data=arithmetic",
         "optim=adamw", "train=default", f"run.dir={tmp_path}",
         f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
         "distributed.process_id=1", "distributed.init_timeout_s=3"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.perf_counter() - start < 60
    assert done.stderr.strip().splitlines() == [
        f"gpurl: error: could not reach the coordinator at 127.0.0.1:{port} within 3 s; check "
        f"distributed.coordinator and that process 0 of the job is running."]



# Orbax leaves the coroutines of the refused restore to the garbage collector.
@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_checkpoint_of_another_model_is_one_sentence(tmp_path):
    cfg = sft_config(tmp_path / "run", steps=1)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e-3))
    train(cfg)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=16),
                                train=dataclasses.replace(cfg.train, steps=2))
    with pytest.raises(ConfigError) as err:
        train(other)
    message = str(err.value)
    assert "\n" not in message and "was written for another model or optimizer" in message
    assert f"set a new run.dir, or rerun with the config the run was started with " \
           f"({tmp_path / 'run'}/config.yaml)" in message
    del err
    time.sleep(1)  # the refused reads finish (and warn) inside this test
    gc.collect()


def test_tokenizer_larger_than_the_model_vocabulary():
    from gpurl.models.loading import load_tokenizer

    with pytest.raises(ConfigError, match=r"The tokenizer has 259 ids but model.vocab_size=100; "
                                          r"set model.vocab_size to at least 259."):
        load_tokenizer(ModelConfig(**dict(TINY_MODEL, vocab_size=100), tokenizer="bytes"))


def test_rl_prompts_longer_than_the_limit_are_skipped_and_counted():
    from gpurl.models.tokenizer import byte_tokenizer
    from gpurl.rollout.prompts import encode_prompts

    rows = [{"prompt": "1 + 1 ="}, {"prompt": "x" * 40}, {"prompt": "2 + 2 ="}]
    kept, skipped = encode_prompts(rows, byte_tokenizer(), False, 16, "train")
    assert skipped == 1 and [r["prompt"] for r in kept.rows] == ["1 + 1 =", "2 + 2 ="]
    with pytest.raises(ConfigError, match="every train prompt is longer than data.max_len=4 "
                                          "tokens; raise data.max_len."):
        encode_prompts(rows, byte_tokenizer(), False, 4, "train")


# ---------------------------------------------------------------- nothing runs as code


def test_config_strings_are_never_evaluated(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from gpurl.cli import validate

    monkeypatch.chdir(tmp_path)
    payload = "__import__('os').system('touch PWNED')"
    cfg = validate([f"run.name=\"{payload}\"", "logger.tags=[\"$(touch PWNED2)\"]"])
    assert cfg.run.name == payload and cfg.logger.tags == ("$(touch PWNED2)",)
    assert not any(OmegaConf.has_resolver(name) for name in ("eval", "python", "exec"))
    with pytest.raises(ConfigError, match="neither built in"):
        load([payload])  # a reward name is imported as pkg.module:function, never evaluated
    # config.yaml of a run directory is read with yaml.safe_load: no Python tags.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run: !!python/object/apply:os.system ['touch PWNED3']\n")
    from gpurl.train.restore import restore_run

    with pytest.raises(ConfigError, match="config.yaml is not a gpurl config"):
        restore_run(run)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


class _Payload:
    def __reduce__(self):
        return (Path.touch, (Path("PWNED"),))


@pytest.mark.e2e
def test_checkpoints_never_unpickle(tmp_path, monkeypatch):
    """Orbax stores arrays with tensorstore and metadata as JSON: a restore works with
    every Python unpickler disabled, and pickles planted in the checkpoint are ignored."""
    cfg = sft_config(tmp_path / "run", steps=1)
    train(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e-3)))
    monkeypatch.chdir(tmp_path)
    step_dir = tmp_path / "run" / "checkpoints" / "1"
    for planted in (step_dir / "state" / "evil.pkl", step_dir / "evil.pickle",
                    step_dir / "meta" / "metadata.pkl"):
        planted.write_bytes(pickle.dumps(_Payload()))

    def refuse(*_, **__):
        raise AssertionError("a checkpoint restore tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(np, "load", refuse)
    state, meta = restore_state(tmp_path / "run", 1)
    assert meta["step"] == 1 and jax.tree.leaves(state.params)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("error", [NonFiniteError("step 7: the loss (nan) or ..."),
                                   RewardError("reward function 'f' did not return ...")])
def test_the_command_line_prints_such_errors_as_one_line(tmp_path, monkeypatch, capsys, error):
    import gpurl.cli
    from gpurl.cli import main

    def fail(cfg, *_):
        raise error

    monkeypatch.setattr(gpurl.cli, "train", fail)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "algo=sft", "model=tiny", "data=arithmetic", "optim=adamw",
              "train=default", f"run.dir={tmp_path}"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"gpurl: error: {error}"]


@pytest.mark.slow
def test_a_checkpoint_of_per_layer_parameters_restores_stacked(tmp_path):
    """Checkpoints of earlier versions hold one entry per layer ("params.blocks.1.attn.q",
    and the same under the optimizer's moments); they restore into the stacked layout."""
    import orbax.checkpoint as ocp

    from gpurl.train.checkpoint import _flat
    from gpurl.train.step import make_init

    cfg = make_config(model=TINY_MODEL)
    spec, optimizer = model_spec(cfg.model), make_optimizer(cfg.optim, cfg.train.steps)
    place = placement(spec, optimizer, trainer_mesh(MeshConfig(data=1, fsdp=2), jax.devices()[:2]),
                      cfg.mesh.train_rules)
    state = make_init(spec, optimizer, place, seed=0)()
    state = state.replace(params=jax.tree.map(lambda x: x + 1.0, state.params))  # not the init
    old = {}
    for key, value in _flat(state).items():
        if ".blocks." in key:
            head, _, tail = key.partition(".blocks.")
            old.update({f"{head}.blocks.{i}.{tail}": value[i] for i in range(value.shape[0])})
        else:
            old[key] = value
    assert any(".blocks.1." in k for k in old) and sum(".mu.blocks.0." in k for k in old) > 3
    manager = ocp.CheckpointManager(tmp_path, item_names=("state", "meta"))
    manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(old),
                                            meta=ocp.args.JsonSave({"step": 3})))
    manager.wait_until_finished()
    manager.close()
    ckpt = Checkpointer(tmp_path, keep=2)
    restored, meta = ckpt.restore(3, place.abstract_state, place.state)
    ckpt.close()
    assert meta == {"step": 3}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert restored.params["blocks"]["attn"]["q"].sharding == place.state.params["blocks"]["attn"]["q"]

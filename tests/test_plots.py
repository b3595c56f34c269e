"""What a run leaves for people to look at: curves.png and `gpurl plot`, the multirun
summary table, the progress bar, the wandb run (offline) and the TensorBoard event files."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.config import ConfigError, LoggerConfig
from gpurl.train import plots
from gpurl.train.loop import train
from gpurl.train.metrics import TENSORBOARD_DIR, WANDB_ID_FILE, MetricsSink, wandb_init_kwargs

PNG = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir: Path, steps: int, rl: bool) -> Path:
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": 0.3}] if rl else []
    for s in range(1, steps + 1):
        row = {"step": s, "loss": 1.0 / s, "tokens_per_s": 100.0}
        row.update({"reward/mean": 0.1 * s, "kl": 0.01 * s} if rl else {})
        rows.append(row)
    rows.append({"step": steps, "eval/accuracy" if rl else "eval/loss": 0.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def _gpurl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpurl.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


def test_panels_without_data_are_skipped(tmp_path):
    rl = plots.read_metrics(_write_run(tmp_path / "rl", 3, rl=True))
    sft = plots.read_metrics(_write_run(tmp_path / "sft", 3, rl=False))
    assert rl["eval/accuracy"] == ([0, 3], [0.3, 0.5])
    titles = lambda runs: [p.title for p in plots.present_panels(runs)]  # noqa: E731
    assert titles([rl]) == ["reward (mean)", "loss", "KL to reference", "held-out accuracy"]
    assert titles([sft]) == ["loss", "held-out loss"]
    assert len(titles([rl, sft])) == 5
    assert plots.write_curves(tmp_path / "rl").read_bytes().startswith(PNG)


@pytest.mark.e2e
def test_plot_command_overlays_runs_and_fails_in_one_sentence(tmp_path):
    a, b = _write_run(tmp_path / "a", 4, rl=True), _write_run(tmp_path / "b", 6, rl=True)
    done = _gpurl("plot", str(a), str(b), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "plot.png").read_bytes().startswith(PNG)
    out = tmp_path / "sub" / "both.png"
    assert _gpurl("plot", str(a), str(b), f"out={out}").returncode == 0
    assert out.read_bytes().startswith(PNG)
    (tmp_path / "empty").mkdir()
    for args, expected in (([str(tmp_path / "nope")], "does not exist"),
                           ([str(tmp_path / "empty")], "holds no metrics.jsonl rows"),
                           ([], "needs at least one run directory")):
        failed = _gpurl("plot", *args)
        assert failed.returncode == 2
        assert failed.stderr.count("\n") == 1 and expected in failed.stderr, failed.stderr
    with pytest.raises(ConfigError, match="does not exist"):
        plots.read_metrics(tmp_path / "nope")


@pytest.mark.e2e
def test_sweep_prints_a_table_and_each_job_has_curves(tmp_path):
    sweep = tmp_path / "sweep"
    done = _gpurl("train", "-m", "algo=sft", "model=tiny", "data=arithmetic", "optim=adamw",
                  "train=default", "train.steps=3,4", "train.eval_every=0",
                  "logger.progress=false", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for job in ("0", "1"):
        assert (sweep / job / "curves.png").read_bytes().startswith(PNG)
        assert json.loads((sweep / job / "summary.json").read_text())["finished"]
    table = done.stdout[done.stdout.index("sweep summary"):].splitlines()
    assert table[1].split()[:3] == ["job", "overrides", "eval/loss"]
    assert table[3].split()[:2] == ["0", "train.steps=3"]
    assert table[4].split()[:2] == ["1", "train.steps=4"]
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["overrides"] for r in rows] == ["train.steps=3", "train.steps=4"]
    assert all(float(r["eval/loss"]) > 0 and r["run_dir"] for r in rows)


def test_progress_bar_shows_step_reward_loss_tokens_eta(tmp_path, capsys):
    sink = MetricsSink(LoggerConfig(), tmp_path, {}, total_steps=10, start_step=0, enabled=True)
    sink._bar_args["mininterval"] = 0
    for step in (1, 2):
        sink.advance()
        sink.log(step, {"loss": 0.25, "reward/mean": 0.5, "tokens_per_s": 1500.0,
                        "time/rollout_s": 2.0, "time/reward_s": 0.5, "time/train_s": 3.0,
                        "time/sync_s": 0.0})
        sink._bar.refresh()
    sink.close()
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-2]
    for part in ("step 2/10", "ETA", "reward=0.5", "loss=0.25", "tok/s=1500"):
        assert part in last, last
    assert "rollout 2.00 s, reward 0.50 s, train 3.00 s, sync 0.00 s" in err
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["time/train_s"] == 3.0


def test_wandb_run_from_config_and_resumed_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "grpo-run"
    run_dir.mkdir()
    cfg = LoggerConfig(name="wandb", project="proj", group="sweep-1", tags=["a", "b"],
                       progress=False)
    kwargs = wandb_init_kwargs(cfg, run_dir, {"run": {"name": None}})
    assert (kwargs["project"], kwargs["group"], kwargs["tags"], kwargs["name"]) == (
        "proj", "sweep-1", ["a", "b"], "grpo-run")
    assert (kwargs["mode"], kwargs["resume"]) == ("offline", "allow")
    assert wandb_init_kwargs(cfg, run_dir, {"run": {"name": "mine"}})["name"] == "mine"
    ids = []
    for start in (0, 2):  # a run, then its resumption from step 2
        sink = MetricsSink(cfg, run_dir, {"run": {"name": None}}, 4, start, enabled=True)
        sink.log(start + 1, {"loss": 1.0})
        ids.append(sink._wandb.id)
        assert (sink._wandb.group, tuple(sink._wandb.tags)) == ("sweep-1", ("a", "b"))
        sink.close()
    stored = (run_dir / WANDB_ID_FILE).read_text().strip()
    assert ids == [stored, stored]
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(f"-{stored}" in name for name in offline)


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar tag, as TensorBoard's own reader sees the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every one
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


@pytest.mark.e2e
def test_tensorboard_scalars_equal_metrics_jsonl_across_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    cfg = make_config(model=TINY_MODEL, data={"max_len": 24, "num_train": 32, "num_eval": 8},
                      logger={"name": "tensorboard", "progress": False},
                      train={"steps": 4, "batch_size": 8, "eval_every": 2, "eval_batch_size": 8,
                             "checkpoint_every": 2, "keep_checkpoints": 2},
                      run={"dir": str(run_dir)})
    train(cfg)
    # A crash after step 4 was logged but before its checkpoint: the rerun resumes from
    # step 2 and redoes steps 3 and 4 (their timings differ, so stale events would show).
    shutil.rmtree(run_dir / "checkpoints/4")
    train(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    expected: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step":  # TensorBoard stores a scalar as float32
                expected.setdefault(key, []).append((row["step"], float(np.float32(value))))
    assert {"loss", "eval/loss", "time/step_s"} <= expected.keys()
    assert _tensorboard_scalars(run_dir / TENSORBOARD_DIR) == expected
    assert len(list((run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 2


def test_tensorboard_keeps_tags_and_a_missing_package_is_one_sentence(tmp_path, monkeypatch):
    cfg = LoggerConfig(name="tensorboard", progress=False)
    sink = MetricsSink(cfg, tmp_path, {}, total_steps=2, start_step=0, enabled=True)
    sink.log(1, {"eval/pass@1": 0.25, "reward/my fn": -1.5})
    sink.close()
    assert _tensorboard_scalars(tmp_path / TENSORBOARD_DIR) == {
        "eval/pass@1": [(1, 0.25)], "reward/my fn": [(1, -1.5)]}
    quiet = MetricsSink(cfg, tmp_path / "other", {}, 2, 0, enabled=False)  # not process 0
    quiet.log(1, {"loss": 1.0})
    quiet.close()
    assert not (tmp_path / "other").exists()
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboardX"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: imports fail
    with pytest.raises(ConfigError, match=r"^logger=tensorboard needs the tensorboardX package.*"
                                          r"`pip install tensorboardX`"):
        MetricsSink(cfg, tmp_path, {}, 2, 0, enabled=True)

"""Metrics sinks: console progress bar, `metrics.jsonl`, Weights & Biases and TensorBoard.

Only process 0 writes; the other processes get a sink that does nothing, so the loop
never branches on the process index.
"""

from __future__ import annotations

import json
import os
import secrets
import string
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import jax

from gpurl.config import ConfigError, LoggerConfig, LoggerName


def _fmt(value: float) -> str:
    return f"{value:.4g}"


# Shown on the progress bar, in this order, when a step logs them: postfix name -> metric.
BAR_METRICS = (("reward", "reward/mean"), ("loss", "loss"), ("tok/s", "tokens_per_s"),
               ("eval_acc", "eval/accuracy"), ("eval_loss", "eval/loss"))
BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}, ETA {remaining}, {rate_fmt}{postfix}"
PHASES = ("time/rollout_s", "time/reward_s", "time/train_s", "time/sync_s")


class DeviceTimer:
    """Host seconds from now (a dispatch) until `value` is ready on device, as a metric.

    The step never waits for its device work; the time is taken at the first point the
    host waits for it anyway (`observe`: the next step's weight sync, as its batch source
    reports it), or, when nothing
    waited before the metrics are read, on reading (`float`). `exclude` takes out host
    time spent on other work meanwhile (a rollout overlapped with training)."""

    def __init__(self, value: Any, start: float | None = None, watch: bool = False):
        self.start = time.perf_counter() if start is None else start
        self.value, self.end, self.excluded = value, None, 0.0
        # watch: a thread takes the end when `value` is ready, while the host dispatches on
        # (a phase the host never waits for by itself: the prepare step before its train step)
        self._watcher = threading.Thread(target=self._wait, daemon=True) if watch else None
        if self._watcher is not None:
            self._watcher.start()

    def _wait(self) -> None:
        jax.block_until_ready(self.value)
        self.observe()
        self.value = None  # (the arrays it watched may go before the metrics are read)

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def observe(self, at: float | None = None) -> None:
        """Called right after the host waited for `value` (or for what follows it), or
        with the host time `at` which it was first seen computed."""
        if self.end is None:
            self.end = time.perf_counter() if at is None else at

    def __float__(self) -> float:
        if self._watcher is not None:
            self._watcher.join()
        if self.end is None:
            jax.block_until_ready(self.value)
            self.observe()
        return max(self.end - self.start - self.excluded, 0.0)


class Within:
    """The time of a phase that lies within another (the prepare step within the train
    phase): at most that one's. The two ends are taken on different host threads (a watcher
    for the inner phase), and under load the watcher can wake after the main thread has
    already seen the outer phase end."""

    def __init__(self, inner: DeviceTimer, outer: DeviceTimer):
        self.inner, self.outer = inner, outer

    def __float__(self) -> float:
        outer = float(self.outer)
        return min(float(self.inner), outer)


class Sum:
    """A metric adding values that may live on different devices (under split placement
    the rollout's metrics on the rollout devices, the prepare step's on the trainer's): added
    on the host when the loop reads it."""

    def __init__(self, *values: Any):
        self.values = values

    def __float__(self) -> float:
        return sum(float(v) for v in self.values)


class MetricsSink:
    """Writes each step's scalars to every enabled destination."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: Mapping[str, Any],
                 total_steps: int, start_step: int, enabled: bool):
        self.enabled = enabled
        self._bar = None
        self._bar_args = None
        self._shown: dict[str, str] = {}
        self._phase_totals = {k: 0.0 for k in PHASES}
        self._phase_steps = 0
        self._wandb = None
        self._tensorboard = None
        self._jsonl = None
        if not enabled:
            return
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._bar_args = (dict(total=total_steps, initial=start_step, desc="step",
                               bar_format=BAR_FORMAT, dynamic_ncols=True, file=sys.stderr,
                               mininterval=0.5 if sys.stderr.isatty() else 10.0)
                          if cfg.progress else None)
        if cfg.name == LoggerName.WANDB.value:
            self._wandb = _start_wandb(cfg, run_dir, config)
        if cfg.name == LoggerName.TENSORBOARD.value:
            self._tensorboard = TensorBoardWriter(run_dir, start_step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        values = {k: float(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)
        if self._tensorboard is not None:
            self._tensorboard.log(step, values)
        if PHASES[0] in metrics:
            self._phase_steps += 1
            for k in PHASES:
                self._phase_totals[k] += float(metrics.get(k, 0.0))
        if self._bar is not None:
            self._shown.update({name: _fmt(metrics[k]) for name, k in BAR_METRICS if k in metrics})
            self._bar.set_postfix({n: self._shown[n] for n, _ in BAR_METRICS if n in self._shown},
                                  refresh=False)

    def advance(self, steps: int = 1) -> None:
        if self._bar is None and self._bar_args is not None:
            from tqdm import tqdm  # opened at the first step, after the start-up lines

            self._bar = tqdm(**self._bar_args)
        if self._bar is not None:
            self._bar.update(steps)

    def message(self, text: str) -> None:
        """A line on the console that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def phase_summary(self) -> str | None:
        """Mean seconds per step of each RL phase over this session's steps."""
        if not self._phase_steps:
            return None
        parts = [f"{k[5:-2]} {self._phase_totals[k] / self._phase_steps:.2f} s" for k in PHASES]
        return f"[gpurl] mean time per step ({self._phase_steps} steps): " + ", ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        line = self.phase_summary() if self.enabled else None
        if line:
            print(line, file=sys.stderr, flush=True)
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


WANDB_ID_FILE = "wandb_id"  # in run.dir: the wandb run id, so a resumed run continues it


def wandb_run_id(run_dir: Path) -> str:
    """The run's wandb id: read from run.dir, or created and stored there on first use."""
    path = run_dir / WANDB_ID_FILE
    if path.exists() and path.read_text().strip():
        return path.read_text().strip()
    alphabet = string.ascii_lowercase + string.digits  # wandb's run-id alphabet
    run_id = "".join(secrets.choice(alphabet) for _ in range(8))
    path.write_text(run_id + "\n")
    return run_id


def wandb_init_kwargs(cfg: LoggerConfig, run_dir: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments of `wandb.init`, all from the config (and the run's stored id)."""
    mode = cfg.mode
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return dict(project=cfg.project, entity=cfg.entity, group=cfg.group, tags=list(cfg.tags),
                name=config.get("run", {}).get("name") or run_dir.resolve().name,
                dir=str(run_dir), mode=mode, config=dict(config),
                id=wandb_run_id(run_dir), resume="allow")


def _start_wandb(cfg: LoggerConfig, run_dir: Path, config: Mapping[str, Any]):
    import wandb

    return wandb.init(**wandb_init_kwargs(cfg, run_dir, config))


TENSORBOARD_DIR = "tensorboard"  # in run.dir: the event files of logger=tensorboard


class TensorBoardWriter:
    """Each logged step's scalars as one event in an event file under run.dir/tensorboard/.

    Not tensorboardX's SummaryWriter: it renames tags holding characters other than
    letters, digits and `_-./` (`eval/pass@1` becomes `eval/pass_1`) and writes from a
    thread, so its flush does not promise the event is on disk. Here the tags are the
    metrics.jsonl keys, and each event is on disk when `log` returns, as a metrics.jsonl
    row is, so a checkpoint never covers a step TensorBoard lacks. A session first writes
    a restart marker at its first step (0 for a fresh run): TensorBoard then hides what
    earlier sessions logged from that step on, the steps a resumed run redoes
    (metrics.jsonl drops their rows)."""

    def __init__(self, run_dir: Path, start_step: int):
        try:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            from tensorboardX.proto.summary_pb2 import Summary
        except ImportError as e:
            raise ConfigError("logger=tensorboard needs the tensorboardX package, which is not "
                              "installed; run `pip install tensorboardX` or set "
                              "logger=console.") from e
        self._event, self._summary = Event, Summary
        directory = run_dir / TENSORBOARD_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(directory / "events"))
        restart = start_step + 1 if start_step else 0
        self._write(Event(step=restart, session_log=SessionLog(status=SessionLog.START)))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        scalars = [self._summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        self._write(self._event(step=step, summary=self._summary(value=scalars)))

    def _write(self, event: Any) -> None:
        event.wall_time = time.time()
        self._writer.write_event(event)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

"""Metrics sinks: console progress bar, `metrics.jsonl`, and Weights & Biases.

Only process 0 writes; the other processes get a sink that does nothing, so the loop
never branches on the process index.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from gpurl.config import LoggerConfig, LoggerName


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class MetricsSink:
    """Writes each step's scalars to every enabled destination."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: Mapping[str, Any],
                 total_steps: int, start_step: int, enabled: bool):
        self.enabled = enabled
        self._bar = None
        self._bar_args = None
        self._wandb = None
        self._jsonl = None
        if not enabled:
            return
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._bar_args = (dict(total=total_steps, initial=start_step, desc="train",
                               dynamic_ncols=True, file=sys.stderr,
                               mininterval=0.5 if sys.stderr.isatty() else 10.0)
                          if cfg.progress else None)
        if cfg.name == LoggerName.WANDB.value:
            self._wandb = _start_wandb(cfg, run_dir, config)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)
        if self._bar is not None:
            shown = {k: _fmt(v) for k, v in metrics.items() if k in ("loss", "eval/loss", "lr")}
            self._bar.set_postfix(shown, refresh=False)

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

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(cfg: LoggerConfig, run_dir: Path, config: Mapping[str, Any]):
    import wandb

    mode = cfg.mode
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    # The run id is derived from run.dir, so a resumed run continues the same wandb run.
    run_id = "gpurl-" + hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return wandb.init(project=cfg.project, entity=cfg.entity, dir=str(run_dir), mode=mode,
                      name=config.get("run", {}).get("name") or run_dir.name,
                      config=dict(config), id=run_id, resume="allow")

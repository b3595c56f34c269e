"""Training curves from `metrics.jsonl`: `curves.png` at the end of a run, and
`gpurl plot RUN_DIR...` to overlay several runs.

Panels: reward (`reward/mean`), loss, KL (`kl`), held-out accuracy (`eval/accuracy`, or
SFT's `eval/token_accuracy`) and held-out loss (`eval/loss`) against the step. A panel
whose keys no run logged is left out. matplotlib draws with the Agg backend (no display).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from gpurl.config import ConfigError

Series = dict[str, tuple[list[int], list[float]]]  # metric key -> (steps, values)


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # metrics drawn in this panel, the first one present per run wins
    is_eval: bool = False  # eval figures are sparse: draw markers


PANELS = (
    Panel("reward (mean)", ("reward/mean",)),
    Panel("loss", ("loss",)),
    Panel("KL to reference", ("kl",)),
    Panel("held-out accuracy", ("eval/accuracy", "eval/token_accuracy"), is_eval=True),
    Panel("held-out loss", ("eval/loss",), is_eval=True),
)
SMOOTH_ABOVE = 50  # per-step curves longer than this are drawn faint, under a moving average


def read_metrics(run_dir: str | Path) -> Series:
    """Every numeric key of `run_dir/metrics.jsonl` as (steps, values); raises ConfigError
    with one sentence when the directory or its metrics are missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist; give a gpurl run directory "
                          f"(the run.dir of a training run).")
    path = run_dir / "metrics.jsonl"
    if not path.exists() or path.stat().st_size == 0:
        raise ConfigError(f"{run_dir} holds no metrics.jsonl rows; plot a run directory that "
                          f"has trained at least one step.")
    series: Series = {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # a run killed mid-write leaves a partial last line
            raise ConfigError(f"{path} line {number} is not JSON; fix or delete that line.") from None
        step = row.get("step")
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and step is not None:
                steps, values = series.setdefault(key, ([], []))
                steps.append(int(step))
                values.append(float(value))
    return series


def _smooth(values: list[float]) -> list[float]:
    """Centered moving average over about 1/10 of the run (no lag, unlike an EMA); the
    window shrinks at the ends."""
    half = max(2, len(values) // 20)
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half), min(len(values), i + half + 1)
        out.append((sums[hi] - sums[lo]) / (hi - lo))
    return out


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """The directory names, or the paths as given where two names clash (sweep jobs 0, 1)."""
    names = [p.name or str(p) for p in run_dirs]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, run_dirs)]


def present_panels(runs: Sequence[Series]) -> list[Panel]:
    """The panels at least one run has data for, in PANELS order."""
    return [p for p in PANELS if any(k in series for series in runs for k in p.keys)]


def _draw_panel(ax, panel: Panel, runs: list[tuple[str, Series]], colors: list[str]) -> list[str]:
    """One line per run (the same color in every panel); returns the keys drawn."""
    drawn: list[str] = []
    for i, (label, series) in enumerate(runs):
        key = next((k for k in panel.keys if k in series), None)
        if key is None:
            continue
        drawn += [key] if key not in drawn else []
        steps, values = series[key]
        color = colors[i % len(colors)]
        if panel.is_eval:
            ax.plot(steps, values, "o-", color=color, label=label, markersize=4)
        elif len(values) > SMOOTH_ABOVE:
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, _smooth(values), color=color, label=label, linewidth=1.6)
        else:
            ax.plot(steps, values, ".-", color=color, label=label, markersize=3)
    return drawn


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, title: str | None = None) -> Path | None:
    """Draws the panels of every run into one PNG at `out`; None when no panel has data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - MaxNLocator

    dirs = [Path(d) for d in run_dirs]
    runs = list(zip(_labels(dirs), [read_metrics(d) for d in dirs]))
    panels = present_panels([series for _, series in runs])
    if not panels:
        return None
    cols = 2 if len(panels) == 4 else min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.6 * rows), squeeze=False)
    all_steps = [s for _, series in runs for p in panels for k in p.keys if k in series
                 for s in series[k][0]]
    lo, hi = min(all_steps), max(all_steps)
    for ax, panel in zip(axes.flat, panels):
        drawn = _draw_panel(ax, panel, runs, plt.rcParams["axes.prop_cycle"].by_key()["color"])
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(", ".join(drawn))
        ax.set_xlim(lo - 0.03 * (hi - lo) - 0.5, hi + 0.03 * (hi - lo) + 0.5)  # panels share steps
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_curves(run_dir: str | Path) -> Path | None:
    """`run_dir/curves.png` of one run (called by process 0 at the end of training)."""
    run_dir = Path(run_dir)
    title = "/".join(run_dir.resolve().parts[-2:])  # sweep jobs are named 0, 1, ...: keep the parent
    return plot_runs([run_dir], run_dir / "curves.png", title=title)

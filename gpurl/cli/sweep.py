"""After `gpurl train -m`: one row per finished job (its overrides and final eval figures),
printed as a table and written to <sweep dir>/summary.csv (`hydra.callbacks` in
configs/config.yaml)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

SWEEP_JOB_FILE = "gpurl_job.json"  # in each sweep job's directory: its number, overrides, run dir


def sweep_rows(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per finished job of a sweep: job number, the overrides that differ between
    jobs (`overrides`), all of them (`all_overrides`), run dir and final eval figures."""
    jobs = sorted((json.loads(p.read_text()) for p in Path(sweep_dir).rglob(SWEEP_JOB_FILE)),
                  key=lambda job: job["num"])
    common = set.intersection(*(set(job["overrides"]) for job in jobs)) if len(jobs) > 1 else set()
    rows = []
    for job in jobs:
        summary_path = Path(job["run_dir"]) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        rows.append({"job": job["num"],
                     "overrides": " ".join(o for o in job["overrides"] if o not in common),
                     "all_overrides": " ".join(job["overrides"]), "run_dir": job["run_dir"],
                     **{k: v for k, v in summary.items() if k.startswith("eval/")}})
    return rows


def _eval_keys(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith("eval/")})


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of `sweep_rows` (eval figures to 4 significant digits)."""
    keys = ["job", "overrides"] + _eval_keys(rows)
    cells = [[(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "-")))
              for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

    return "\n".join([line(keys), line(["-" * w for w in widths])] + [line(c) for c in cells])


def write_sweep_summary(sweep_dir: str | Path) -> Path | None:
    """Prints the table of a sweep's jobs and writes it to `sweep_dir/summary.csv`."""
    rows = sweep_rows(sweep_dir)
    if not rows:
        print(f"[gpurl] sweep {sweep_dir}: no finished job to summarize.", flush=True)
        return None
    out = Path(sweep_dir) / "summary.csv"
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, restval="", fieldnames=["job", "overrides", *_eval_keys(rows),
                                                           "run_dir", "all_overrides"])
        writer.writeheader()
        writer.writerows(rows)
    varying = rows[0]["overrides"].split()
    common = [o for o in rows[0]["all_overrides"].split() if o not in varying]
    shared = f"; every job: {' '.join(common)}" if common and len(rows) > 1 else ""
    print(f"[gpurl] sweep summary ({len(rows)} jobs, also in {out}{shared}):\n"
          f"{sweep_table(rows)}", flush=True)
    return out


def sweep_summary_callback() -> Any:
    """Hydra callback (configs/config.yaml, hydra.callbacks): the table at the end of `-m`."""
    return SweepSummary()


class SweepSummary(Callback):
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        write_sweep_summary(config.hydra.sweep.dir)

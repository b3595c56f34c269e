"""`srun -n 2 gpurl train` on a real (private, single-node) Slurm: the two tasks form one
JAX job from the SLURM_* variables alone, share one run directory, write each metrics row
once, and leave a checkpoint that restores."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import xla_flags
from gpurl.train.restore import restore_run
import slurm_cluster
from slurm_cluster import LocalSlurm

from test_multiprocess import TINY_GRPO_ARGS as GRPO_ARGS

pytestmark = pytest.mark.slurm

local_slurm = slurm_cluster.local_slurm  # the session fixture: a private single-node Slurm


def _gpurl() -> list[str]:
    """The installed console script (what users run), else the module."""
    script = Path(sys.executable).parent / "gpurl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpurl.cli"]


def test_srun_two_tasks_train_grpo_into_one_run(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # One CPU device per task (conftest forces 4 in this process's XLA_FLAGS, which srun
    # would otherwise pass on); --label prefixes each line with its task id.
    env = local_slurm.env(XLA_FLAGS=xla_flags(1),
                          JAX_PLATFORMS="cpu")
    cmd = ["srun", "--label", "-n", "2", "--ntasks-per-node=2", "-c", "1", "--time=5",
           "--kill-on-bad-exit=1", *_gpurl(), "train", *GRPO_ARGS, f"run.dir={run_dir}"]
    try:
        done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"srun did not finish in 300 s.\n{e.stdout}\n{local_slurm.log_tails()}") from None
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{out}\n{local_slurm.log_tails()}"
    for i in range(2):
        assert f"{i}: [gpurl] process {i}/2 backend=cpu" in out, out

    assert [p.name for p in tmp_path.iterdir()] == ["run"], "tasks wrote outside run.dir"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 3]
    assert len(rows) == 5, rows  # nothing written twice
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 3 and summary["finished"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["3"]

    cfg, params = restore_run(run_dir)
    assert cfg.train.steps == 3 and cfg.algo.num_generations == 4
    leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
    assert sum(x.size for x in leaves) == int(re.search(r"tiny \(([\d,]+) params\)", out)
                                              .group(1).replace(",", ""))
    assert all(np.isfinite(x).all() for x in leaves)

"""A sweep submitted through submitit to a real (private, single-node) Slurm:
`gpurl train -m hydra/launcher=slurm` runs each job as its own Slurm job of 2 tasks that
form one JAX job, and the sweep ends with the summary table."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import xla_flags
import slurm_cluster
from slurm_cluster import LocalSlurm

local_slurm = slurm_cluster.local_slurm  # the session fixture: a private single-node Slurm

needs_plugin = pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="needs the submitit launcher plugin: pip install -e '.[slurm]'")


@pytest.mark.slurm
@needs_plugin
def test_submitit_sweep_of_two_jobs_on_local_slurm(local_slurm: LocalSlurm, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # One CPU device per task (conftest forces 4 in this process's XLA_FLAGS).
    env = local_slurm.env(XLA_FLAGS=xla_flags(1),
                          JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "gpurl.cli", "train", "-m", "hydra/launcher=slurm",
           "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1",
           "hydra.launcher.timeout_min=5", "hydra.launcher.partition=debug",
           "algo=sft", "model=tiny", "data=arithmetic", "optim=adamw", "train=default",
           "train.steps=3,4", "train.eval_every=0", "train.batch_size=4",
           "train.eval_batch_size=16", "data.num_eval=16", "logger.progress=false",
           f"hydra.sweep.dir={sweep}"]
    try:
        done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=420)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the sweep did not finish in 420 s.\n{e.stdout}\n{e.stderr}\n"
                             f"{local_slurm.log_tails()}") from None
    logs = "\n".join(p.read_text() for p in sorted(sweep.glob(".submitit/*/*.out"))
                     ) if sweep.exists() else ""
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs}\n{local_slurm.log_tails()}"
    for job, steps in (("0", 3), ("1", 4)):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["step"] == steps and summary["finished"]
        assert (sweep / job / "curves.png").exists()
        rows = (sweep / job / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == steps + 1, rows  # one process wrote: no row twice
    assert "process 1/2 backend=cpu" in logs, logs  # each job was 2 processes
    with open(sweep / "summary.csv") as f:
        assert [r["overrides"] for r in csv.DictReader(f)] == ["train.steps=3", "train.steps=4"]
    assert "sweep summary (2 jobs" in done.stdout


def test_missing_launcher_plugin_is_one_sentence(monkeypatch, capsys) -> None:
    from gpurl import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if "submitit" in name else real(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        cli._check_launcher(["hydra/launcher=slurm", "train.steps=1,2"])
    assert exit_info.value.code == 2
    assert "pip install -e '.[slurm]'" in capsys.readouterr().err
    cli._check_launcher(["hydra/launcher=basic"])  # other launchers need nothing

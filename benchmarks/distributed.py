"""Multi-process costs: weight-sync time of split placement, and the step time of GRPO with
2 processes against 1 process on the same total number of devices.

Weight sync: the trainer parameters of a model preset (random init) go to the rollout
devices with `gpurl.distributed.sync.WeightSync`, as every RL step with
`mesh.placement=split` does (median of --repeats calls after a warm-up), in one process
with --devices host devices split in half; colocated placement is timed too (a no-op
`device_put` when the layouts agree).

Process overhead: `gpurl train` GRPO on a small random model for --steps steps, launched
as 1 process x 4 devices and as 2 processes x 2 devices (real `jax.distributed`
processes, gloo collectives); the table gives the median `time/step_s` after the first
(compiling) step and its phases.

    python benchmarks/distributed.py --model gemma3_270m --json dist.json
    # tiny model, 2 steps, 1 process colocated only (2 processes take 90 s on 2 cores; the
    # multiprocess test tier launches them): the script runs
    python benchmarks/distributed.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

GRPO_ARGS = ["algo=grpo", "model=tiny", "model.tokenizer=bytes", "data=arithmetic", "data.num_train=256", "data.num_eval=8", "data.max_len=16",
             "optim=adamw", "optim.lr=1e-3", "optim.warmup_steps=0", "optim.decay=constant",
             "train=default", "train.batch_size=8", "train.eval_every=0",
             "train.checkpoint_every=0", "train.eval_pass_k=0", "rollout=default",
             "rollout.max_new_tokens=16", "algo.num_generations=4", "logger.progress=false"]
WIDER = ["model.d_model=256", "model.num_layers=4", "model.mlp_dim=1024", "model.head_dim=64"]


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a child process with `devices` host devices, the caller's other flags
    kept (tests/test_benchmarks.py's cheaper compiles reach the children too)."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def sync_times(model: str, devices: int, repeats: int) -> list[dict[str, Any]]:
    """Seconds per weight sync, split and colocated, in a child process with `devices`
    host devices (the device count is fixed when JAX starts)."""
    code = f"""
import json, statistics, time, jax
from gpurl.config import MeshConfig, ModelConfig
from gpurl.distributed.mesh import placement_devices, rollout_mesh, trainer_mesh, tree_shardings
from gpurl.distributed.sync import WeightSync
from gpurl.models import count_params, model_spec
import yaml
from gpurl.cli import config_dir
preset = yaml.safe_load((config_dir() / "model" / "{model}.yaml").read_text())
preset.update(checkpoint=None, dtype="float32")
spec = model_spec(ModelConfig(**preset))
rows = []
for placement in ("split", "colocated"):
    mesh_cfg = MeshConfig(placement=placement, rollout_devices={devices // 2})
    train_devs, roll_devs = placement_devices(mesh_cfg)
    tmesh, rmesh = trainer_mesh(mesh_cfg, train_devs), rollout_mesh(mesh_cfg, roll_devs)
    tsh = tree_shardings(spec.abstract_params, spec.logical_axes, mesh_cfg.train_rules, tmesh)
    rsh = tree_shardings(spec.abstract_params, spec.logical_axes, mesh_cfg.sample_rules, rmesh)
    params = jax.jit(lambda: spec.init(0), out_shardings=tsh)()
    sync = WeightSync(tsh, spec.serving_params(rsh))
    jax.block_until_ready(sync(params))
    times = []
    for _ in range({repeats}):
        t = time.perf_counter(); jax.block_until_ready(sync(params)); times.append(time.perf_counter() - t)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    rows.append(dict(placement=placement, params=count_params(params), gb=nbytes / 1e9,
                     trainer_devices=len(train_devs), rollout_devices=len(roll_devs),
                     median_s=statistics.median(times), gb_per_s=nbytes / 1e9 / statistics.median(times)))
print("ROWS" + json.dumps(rows))
"""
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("ROWS"))
    return json.loads(line[4:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_overhead(steps: int, placement: str, size: list[str],
                     counts: Sequence[int] = (1, 2)) -> list[dict[str, Any]]:
    rows = []
    for processes in counts:
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, XLA_FLAGS=xla_flags(4 // processes), JAX_PLATFORMS="cpu")
            port = _free_port()
            extra_mesh = (["mesh.placement=split", "mesh.rollout_devices=2"]
                          if placement == "split" else [])
            procs = []
            start = time.perf_counter()
            for i in range(processes):
                dist = ([f"distributed.coordinator=127.0.0.1:{port}",
                         f"distributed.num_processes={processes}", f"distributed.process_id={i}"]
                        if processes > 1 else [])
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "gpurl.cli", "train", *GRPO_ARGS, *size, *extra_mesh,
                     f"train.steps={steps}", f"run.dir={tmp}/run", *dist],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            codes = [p.wait() for p in procs]
            wall = time.perf_counter() - start
            if any(codes):
                raise RuntimeError(f"{processes} process run failed: exit codes {codes}")
            metrics = [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
            steps_m = [m for m in metrics if "time/step_s" in m][1:]  # skip the compiling step
            row = {"placement": placement, "processes": processes, "devices": 4, "wall_s": wall}
            for key in ("time/step_s", "time/rollout_s", "time/reward_s", "time/train_s", "time/sync_s"):
                row[key] = statistics.median(m[key] for m in steps_m)
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3_270m", help="model preset for the sync timing")
    parser.add_argument("--devices", type=int, default=2, help="host devices for the sync timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12, help="GRPO steps per launch")
    parser.add_argument("--json", help="also write the tables here")
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 1 sync, 2 steps, "
                        "1 process colocated only: checks the script end to end in seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.devices, args.repeats, args.steps = "tiny", 2, 1, 2
    placements = ("colocated",) if args.smoke else ("colocated", "split")
    size = [] if args.smoke else WIDER
    counts = (1,) if args.smoke else (1, 2)

    sync = sync_times(args.model, args.devices, args.repeats)
    print(f"\nWeight sync, {args.model}, fp32, {args.devices} host devices")
    print("| placement | params | GB | trainer / rollout devices | median s | GB/s |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    for r in sync:
        print(f"| {r['placement']} | {r['params']:,} | {r['gb']:.2f} | {r['trainer_devices']} / "
              f"{r['rollout_devices']} | {r['median_s']:.3f} | {r['gb_per_s']:.1f} |")
    overhead = [row for p in placements for row in process_overhead(args.steps, p, size, counts)]
    print(f"\nGRPO step, 1 process x 4 devices vs 2 processes x 2 devices ({args.steps} steps, "
          f"median after the first)")
    print("| placement | processes | step s | rollout s | reward s | train s | sync s | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in overhead:
        print(f"| {r['placement']} | {r['processes']} | {r['time/step_s']:.3f} | "
              f"{r['time/rollout_s']:.3f} | {r['time/reward_s']:.3f} | {r['time/train_s']:.3f} | "
              f"{r['time/sync_s']:.3f} | {r['wall_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"sync": sync, "processes": overhead}, indent=2))


if __name__ == "__main__":
    main()

"""What the GPU compiler says of GRPO runs: `gpurl plan plan.target=h100` for the runs of
docs/scaling.md ("What the GPU compiler says"), one table row per program with the
compiler's account per unit of work (`gpurl.plan.efficiency`): flops and HBM bytes
against the ideal, the roofline time on an H100 and what it bounds, and each run's bound
on RL tokens/s per GPU. Nothing runs on a GPU: XLA's GPU compiler (the `gpu-plan` extra)
compiles every program for compile-only H100s on this machine, and the numbers are its
account, never a measurement.

    PYTHONPATH=.venv/gpu-compiler python benchmarks/gpu_account.py            # all runs (~10 min)
    PYTHONPATH=.venv/gpu-compiler python benchmarks/gpu_account.py qwen3_1_7b  # one
    python benchmarks/gpu_account.py --smoke   # the tiny model (a note where no compiler is)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["algo=grpo", "plan.target=h100", "data.num_eval=0"]
ROWS_1K = ["rollout.slots=256", "train.batch_size=32", "algo.num_generations=8",
           "rollout.max_new_tokens=960", "plan.prompt_len=64"]  # 256 rows, 1,024-token contexts
RUNS = {
    "qwen3_1_7b": ["model=qwen3_1_7b", *ROWS_1K],
    "gemma2b": ["model=gemma2b", *ROWS_1K],
    # the plan of issue 33, and NeMo RL's 4K sequences (512-token prompts)
    "llama3_8b": ["model=llama3_8b", "plan.devices=8", "mesh.fsdp=8", "mesh.data=1",
                  "train.batch_size=8", "algo.num_generations=8", "rollout.max_new_tokens=1024",
                  "model.remat=full"],
    "llama3_8b_4k": ["model=llama3_8b", "plan.devices=8", "mesh.fsdp=8", "mesh.data=1",
                     "train.batch_size=8", "algo.num_generations=8", "plan.prompt_len=512",
                     "rollout.max_new_tokens=3584", "model.remat=full"],
    # docs/scaling.md's "Where qwen3_30b_a3b fits" (LoRA, capacity 2)
    "qwen3_30b_a3b": ["model=qwen3_30b_a3b", "plan.devices=8", "mesh.data=1", "mesh.expert=8",
                      "train.batch_size=8", "algo.num_generations=8", "plan.prompt_len=512",
                      "rollout.max_new_tokens=1024", "model.lora.rank=16",
                      "model.moe.capacity_factor=2"],
}
SMOKE_RUN = ["model=tiny", "data=arithmetic", "train.batch_size=4", "algo.num_generations=2",
             "rollout.max_new_tokens=16"]
ACCOUNT = re.compile(r"compiler's account, (.+?) per (.+?): ([\d.]+) TFLOP, ([\d.]+) GB of HBM")
IDEAL = re.compile(r"ideal \((.+?)\): .+? -> (.+?) the ideal")
ROOF = re.compile(r"roofline on .+?: ([\d.]+) ms \((\w+)-bound\)(?:; <= ([\d,]+) tokens/s per GPU)?")
BOUND = re.compile(r"compiler's bound on the RL step: ([\d,]+) tokens/s per GPU")


def plan(overrides: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "gpurl.cli", "plan", *COMMON, *overrides],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"gpurl plan {' '.join(overrides)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def rows(name: str, stdout: str) -> list[dict]:
    out, lines = [], stdout.splitlines()
    for i, line in enumerate(lines):
        m = ACCOUNT.search(line)
        if not m:
            continue
        row = {"run": name, "program": m[1], "unit": m[2], "tflop": float(m[3]),
               "gb": float(m[4]), "ratios": "", "ms": "", "bound": "", "tokens/s": ""}
        for follow in lines[i + 1:i + 3]:
            if (ideal := IDEAL.search(follow)):
                row["ratios"] = ideal[2]
            if (roof := ROOF.search(follow)):
                row["ms"], row["bound"], row["tokens/s"] = roof[1], roof[2], roof[3] or ""
        out.append(row)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help=f"some of {', '.join(RUNS)} (default: every one)")
    p.add_argument("--smoke", action="store_true", help="the tiny model's plan: the script runs")
    args = p.parse_args(argv)
    if set(args.runs) - set(RUNS):
        p.error(f"unknown runs {sorted(set(args.runs) - set(RUNS))}; choose from {', '.join(RUNS)}.")
    runs = {"tiny": SMOKE_RUN} if args.smoke else {n: RUNS[n] for n in args.runs or RUNS}
    if args.smoke:
        from gpurl.plan.targets import compiler_installed

        if not compiler_installed():
            print("gpu_account: skipped: XLA's GPU compiler (the gpu-plan extra) is not installed")
            return
    table, bounds = [], {}
    for name, overrides in runs.items():
        stdout = plan(overrides)
        table += rows(name, stdout)
        bounds[name] = (m[1] if (m := BOUND.search(stdout)) else "")
    print("| run | program | per | TFLOP | HBM GB | vs ideal | roofline ms | bound | <= tokens/s/GPU |")
    print("| --- | --- | --- | ---: | ---: | --- | ---: | --- | ---: |")
    for r in table:
        print(f"| {r['run']} | {r['program']} | {r['unit']} | {r['tflop']:.3f} | {r['gb']:.2f} | "
              f"{r['ratios']} | {r['ms']} | {r['bound']} | {r['tokens/s']} |")
    print("\n| run | bound on RL tokens/s per GPU |\n| --- | ---: |")
    for name, value in bounds.items():
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()

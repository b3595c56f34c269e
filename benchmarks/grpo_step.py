"""Where a GRPO step's time goes: rollout / reward / train / sync, from `gpurl train`.

Runs `gpurl train` (the main job by default: GRPO on Gemma 3 270M, 4 prompts x G=8,
<= 8 new tokens; extra Hydra overrides after `--`) for `--steps` steps with evaluation
and checkpoints off, then reads the phase times gpurl logs in
metrics.jsonl (`time/rollout_s`, `time/reward_s`, `time/train_s`, `time/sync_s`,
`time/step_s`) and reports their medians over the steps after the first `--warmup`
(the first step compiles). Peak memory comes from the run's summary.json; the
sampler/trainer mismatch (`mismatch/*`, medians over the same steps) comes along.

    python benchmarks/grpo_step.py --json grpo.json                     # the main job
    python benchmarks/grpo_step.py --json grpo.json -- model=gemma2b train.batch_size=16
    python benchmarks/grpo_step.py --smoke                              # tiny model, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

PHASES = ("rollout", "reward", "train", "sync", "step")
MISMATCH = ("mismatch/logprob_abs_mean", "mismatch/logprob_abs_max", "mismatch/k3_kl",
            "mismatch/over_threshold")
# Evaluation and checkpoints off (none at the end either): only training steps run.
COMMON = ["algo=grpo", "data.num_eval=0", "train.eval_every=0", "train.checkpoint_every=0",
          "train.save_final=false", "logger=console"]
# A tiny random model on CPU: checks this script end to end in seconds.
SMOKE = ["model=tiny", "model.tokenizer=bytes", "data=arithmetic", "data.num_train=64",
         "data.max_len=16", "train.batch_size=4", "algo.num_generations=4",
         "rollout.max_new_tokens=8"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="steps to run (warm-up included)")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    p.add_argument("--smoke", "--cpu-smoke", action="store_true", help="tiny model on CPU, 2 steps")
    p.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "gpurl_grpo_step.json"))
    p.add_argument("overrides", nargs="*", help="Hydra overrides for `gpurl train` (after --)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.overrides = 2, SMOKE + args.overrides
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup: at least one timed step is needed.")
    return args


def run_train(overrides: list[str], steps: int,
              env: dict[str, str] | None = None) -> tuple[list[dict], dict, float]:
    """(metrics.jsonl rows, summary.json, wall seconds) of `gpurl train` for `steps` steps
    with COMMON and `overrides`, in a temporary run directory."""
    with tempfile.TemporaryDirectory(prefix="gpurl_grpo_step_") as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-c", "import sys; from gpurl.cli import main; sys.exit(main())",
                   "train", *COMMON, f"train.steps={steps}", f"run.dir={run_dir}", *overrides]
        print("[grpo_step] gpurl train " + " ".join(command[4:]), flush=True)
        start = time.perf_counter()
        subprocess.run(command, check=True, env=env)
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
        summary = json.loads((run_dir / "summary.json").read_text())
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows, summary, wall


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if args.smoke else {}))
    rows, summary, wall = run_train(args.overrides, args.steps, env)
    every = sorted((r for r in rows if "time/step_s" in r), key=lambda r: r["step"])
    steps = every[args.warmup:]
    medians = {p: round(statistics.median(r[f"time/{p}_s"] for r in steps), 4) for p in PHASES}
    result: dict[str, Any] = {
        "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup,
        "timed_steps": len(steps), "median_s": medians,
        "share": {p: round(medians[p] / medians["step"], 3) for p in PHASES if p != "step"},
        "first_step_s": round(every[0]["time/step_s"], 2),
        "wall_s": round(wall, 1),
        **{k: v for k, v in summary.items() if k.startswith("peak_")},
        "per_step": [{p: r[f"time/{p}_s"] for p in PHASES} for r in steps],
        # the sampler against the trainer (bf16 on a GPU): medians over the timed steps
        "mismatch": {k: statistics.median(r[k] for r in steps) for k in MISMATCH
                     if all(k in r for r in steps)}}
    print("| phase | median s | share of step |")
    print("| --- | ---: | ---: |")
    for p in PHASES:
        share = f"{100 * result['share'][p]:.1f}%" if p in result["share"] else ""
        print(f"| {p} | {medians[p]} | {share} |")
    print("peak memory: " + ", ".join(f"{k} {v}" for k, v in summary.items()
                                      if k.startswith("peak_")))
    print("sampler vs trainer: " + ", ".join(f"{k} {v:.3g}" for k, v in result["mismatch"].items()))
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

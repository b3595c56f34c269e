"""What fits where: `gpurl plan` (every program of a GRPO run compiled ahead of time for
simulated devices, nothing allocated) over the presets, from abstract arrays only.

    # docs/scaling.md: the longest completion (prompt 512, G=8, 8 sequences per device)
    # whose GRPO step and rollout fit, per preset, full fine-tuning and LoRA, with XLA's GPU
    # compiler for 8 compile-only H100s (about 3 plans of 1-4 min per preset and column)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python benchmarks/plan.py table --devices 8 \
        --target h100 --json plan8-h100.json
    # benchmarks/README.md: fixed settings (memory per device, lower + compile time)
    python benchmarks/plan.py settings --devices 8 --json settings8.json
    python benchmarks/plan.py settings --devices 1 --json settings1.json
    # the table of docs/scaling.md from the two table runs
    python benchmarks/plan.py markdown plan1.json plan8.json
    # all three on the tiny model and 4 simulated devices, in seconds: the script runs
    python benchmarks/plan.py --smoke

One process simulates one device count (`plan.devices`, set before JAX starts). On a GPU
machine, `--devices 0` plans for the devices there are (the GPU compiler's figures). With
`--target h100` (JAX's CUDA plugin installed: the `gpu-plan` extra) the programs are
compiled by XLA's GPU compiler for `--devices` compile-only H100s, no GPU needed:

    python benchmarks/plan.py settings --devices 8 --target h100 --json settings8-h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import tempfile
import time
from typing import Any, Sequence

import jax

from gpurl.cli.compose import validate
from gpurl.commands.plan import plan_programs, start_backend
from gpurl.config import ConfigError, PlanConfig
from gpurl.plan.memory import GIB

# Every preset from 1B to 70B parameters, smallest first.
PRESETS = ("gemma3_1b", "llama3_1b", "qwen2_5_1_5b", "qwen3_1_7b", "gemma2b", "gemma2_2b",
           "gemma3_4b", "qwen2_5_7b", "llama3_8b", "qwen3_8b", "gemma7b", "gemma2_9b",
           "gemma3_12b", "qwen2_5_14b", "qwen3_14b", "gemma3_27b", "qwen2_5_32b", "qwen3_32b",
           "llama3_70b")
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def grpo_setting(model: str, devices: int, prompts: int, prompt_len: int, group: int,
                 new_tokens: int) -> tuple[str, int, list[str]]:
    """(name, devices it is meant for, overrides) of one GRPO step to plan."""
    mesh = f"fsdp={devices}" if devices > 1 else "1 device"
    name = f"{model} {mesh}, {prompts} x {prompt_len} x G={group} x {new_tokens}"
    return name, devices, [f"model={model}", f"train.batch_size={prompts}",
                           f"plan.prompt_len={prompt_len}", f"algo.num_generations={group}",
                           f"rollout.max_new_tokens={new_tokens}"]


# The settings and the depth check (llama3_1b beside llama3_8b).
SETTINGS = (grpo_setting("llama3_8b", 8, 8, 512, 8, 1024),
            grpo_setting("llama3_8b", 8, 8, 256, 4, 256),
            grpo_setting("llama3_1b", 8, 8, 512, 8, 1024),
            grpo_setting("gemma2b", 1, 1, 256, 8, 1024))


def mesh_overrides(preset: str) -> list[str]:
    """The layout the table assumes: the trainer fully sharded over every device (a
    mixture-of-experts preset: its experts over every device, `mesh.expert=-1`, with a
    capacity of 2, as docs/scaling.md's "Where qwen3_30b_a3b fits"); the rest (the context
    width, the token budget, the rollout's width and KV pool) the plan's `auto` choices."""
    if validate([f"model={preset}"]).model.moe.num_experts:
        return ["mesh.data=1", "mesh.expert=-1", "model.moe.capacity_factor=2"]
    return ["mesh.data=1", "mesh.fsdp=-1"]


def run_plan(overrides: list[str], extra: list[str]) -> dict[str, Any]:
    """One `gpurl plan` in this process; `extra`: the device count and memory overrides."""
    cfg = validate(["algo=grpo", "data.num_eval=0", "logger.progress=false", *overrides, *extra])
    t0 = time.perf_counter()
    try:
        _, _, plans, _ = plan_programs(cfg)
    except ConfigError as e:  # refused before any program's memory (e.g. a kernel's limit)
        return {"overrides": overrides, "plan_s": round(time.perf_counter() - t0, 2),
                "fits": False, "refused": str(e),
                **{k: {"total_gib": float("nan"), "chosen": []} for k in ("train step", "rollout")}}
    out: dict[str, Any] = {"overrides": overrides, "plan_s": round(time.perf_counter() - t0, 2),
                           "fits": all(p.fits for p in plans)}
    for p in plans:
        out[p.name] = {"total_gib": round(p.total / GIB, 3), "limit_gib": round(p.limit / GIB, 3),
                       "compile_s": round(p.compile_s, 2), "chosen": p.chosen,
                       "parts_gib": {k: round(v / GIB, 3) for k, v in p.parts.items()},
                       "analysis_gib": {k: round(v / GIB, 3) for k, v in p.analysis.items()}}
    return out


def longest(preset: str, devices: int, lora: bool, lengths: Sequence[int],
            extra: list[str]) -> dict[str, Any]:
    """The longest completion in `lengths` whose programs fit. Memory grows with the
    completion length, so a binary search over `lengths` finds it in about log2(len) plans."""
    rows = max(devices, 1) * 8  # 8 sequences per device
    base = [f"model={preset}", f"train.batch_size={rows // 8}", "algo.num_generations=8",
            "plan.prompt_len=512", *mesh_overrides(preset)]
    base += ["model.lora.rank=16"] if lora else []
    tried: dict[int, dict[str, Any]] = {}

    def fits(i: int) -> bool:
        n = lengths[i]
        result = tried[n] = run_plan(base + [f"rollout.max_new_tokens={n}"], extra)
        print(f"  {preset} {'lora' if lora else 'full'} N={n}: "
              + ", ".join(f"{k} {result[k]['total_gib']:.1f}" for k in ("train step", "rollout"))
              + (" GiB: fits" if result["fits"] else " GiB: does NOT fit")
              + (f" ({result['refused']})" if "refused" in result else "")
              + "".join(f"\n    {c}" for k in ("train step", "rollout") for c in result[k]["chosen"]),
              flush=True)
        return result["fits"]

    lo, hi = -1, len(lengths)  # lengths[lo] fits (or lo = -1), lengths[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    best = lengths[lo] if lo >= 0 else None
    return {"preset": preset, "lora": lora, "longest": best,
            "tried": [tried[n] for n in sorted(tried)]}


def table(args: argparse.Namespace, extra: list[str]) -> list[dict]:
    lengths = [int(x) for x in args.lengths.split(",")]
    results = [longest(p, args.devices, lora, lengths, extra)
               for p in args.presets.split(",") for lora in (False, True)]
    print(f"\n| preset | full fine-tuning | LoRA (rank 16) |   ({args.devices or 'local'} "
          f"device(s) of {args.memory_gb or 80:.0f} GiB)\n| --- | ---: | ---: |")
    by = {(r["preset"], r["lora"]): r["longest"] for r in results}
    for preset in args.presets.split(","):
        cells = [f"{by[preset, lora]:,}" if by[preset, lora] else "does not fit"
                 for lora in (False, True)]
        print(f"| `{preset}` | {cells[0]} | {cells[1]} |")
    return results


def settings(args: argparse.Namespace, extra: list[str]) -> list[dict]:
    results = []
    print("| setting | per-device arguments | per-device temp | lower + compile |\n"
          "| --- | ---: | ---: | ---: |")
    for name, devices, overrides in SETTINGS:
        if devices != max(args.devices, 1) and args.devices:
            continue
        for remat in args.remat.split(","):
            r = run_plan(overrides + ["mesh.data=1", "mesh.fsdp=-1", f"model.remat={remat}"],
                         extra)
            step = r["train step"]
            a = step["analysis_gib"]
            print(f"| {name}, remat={remat} | {a['arguments']:.1f} GiB | {a['temp']:.1f} GiB | "
                  f"{step['compile_s']:.1f} s |", flush=True)
            results.append({"setting": name, "remat": remat, **r})
    return results


def markdown(paths: Sequence[str]) -> None:
    """docs/scaling.md's table: one column pair (full, LoRA) per table run."""
    runs = [json.load(open(p)) for p in paths]
    head = " | ".join(f"{r['meta']['devices']} x 80 GiB: full | LoRA" for r in runs)
    print(f"| preset | {head} |\n| --- |" + " ---: | ---: |" * len(runs))
    for preset in PRESETS:
        cells = []
        for r in runs:
            by = {x["lora"]: x["longest"] for x in r["results"] if x["preset"] == preset}
            cells += [f"{by[lora]:,}" if by.get(lora) else "-" for lora in (False, True)]
        print(f"| `{preset}` | " + " | ".join(cells) + " |")


def smoke(args: argparse.Namespace) -> None:
    """The table (the tiny model, one length), one tiny setting, and the table's markdown."""
    global PRESETS, SETTINGS
    PRESETS, SETTINGS = ("tiny",), (grpo_setting("tiny", 4, 4, 16, 2, 16),)
    args.devices, args.presets, args.lengths, args.remat = 4, "tiny", "32", "none"
    start_backend(PlanConfig(devices=args.devices))
    extra = [f"plan.devices={args.devices}"]
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/table.json"
        with open(path, "w") as f:
            json.dump({"meta": {"devices": args.devices}, "results": table(args, extra)}, f)
        settings(args, extra)
        markdown([path])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", choices=("table", "settings", "markdown"),
                   help="--smoke: all three")
    p.add_argument("files", nargs="*", help="markdown: the JSON files of table runs")
    p.add_argument("--devices", type=int, default=8, help="simulated devices; 0 = the real ones")
    p.add_argument("--memory-gb", type=float, default=0.0, help="device memory; 0 = 80 when simulated")
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--remat", default="none,full", help="settings: the remat policies to compare")
    p.add_argument("--target", default="", help="compile for this GPU (plan.target), e.g. h100")
    p.add_argument("--json", default="")
    p.add_argument("--smoke", action="store_true", help="table, settings and markdown on the "
                   "tiny model and 4 simulated devices: checks the script end to end")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke(args)
    if args.what is None:
        p.error("name what to run: table, settings or markdown (or --smoke).")
    if args.what == "markdown":
        return markdown(args.files)
    start_backend(PlanConfig(devices=args.devices, target=args.target))
    extra = [f"plan.devices={args.devices}"] if args.devices else []
    extra += [f"plan.target={args.target}"] if args.target else []
    extra += [f"plan.device_memory_gb={args.memory_gb}"] if args.memory_gb else []
    results = (table if args.what == "table" else settings)(args, extra)
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
                "backend": jax.default_backend(), "machine": platform.processor() or platform.machine(),
                "devices": args.devices, "target": args.target}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

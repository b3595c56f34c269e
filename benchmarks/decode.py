"""Decode throughput of gpurl's rollout engine against the memory-bandwidth bound of the
device and against the GPU compiler's account of the same decode step.

A decode step reads every parameter once and the KV cache of every row up to its current
length, so on a GPU its time is bounded below by (parameter bytes + KV cache bytes read) /
peak HBM bandwidth. This script runs the rollout engine (`gpurl.rollout.engine`: the
paged KV cache and decode chunks RL rollouts run) on random weights of a preset (gemma2b
by default, bf16), `--batch` requests decoding at once (`rollout.slots`), every row to
exactly `--new-tokens` tokens (no stop ids), and reports decode tokens/s and its fraction
of that bound. Decode time is the engine's own: the seconds its decode chunks took and the
steps they ran (`Engine.stats`), so the prefill is left out. The defaults (prompts of
960 tokens, 64 new) put every step near a 1,024-token context: the unit of the
compiler's account of an RL run of 64 + 960-token sequences, whose decode step
`--account FILE` (a `gpurl plan plan.json` of that run: benchmarks/accounts/) gives as a
second bound (its roofline at the full context, recomputed for the GPU measured). Each
figure is the median of `--repeats` calls after a compiling call.

Peak bandwidth comes from the GPU's name (nvidia-smi; H200 4.8 TB/s, H100 SXM 3.35 TB/s)
or `--peak-bw-tbs`. `--smoke` (alias `--cpu-smoke`) runs a tiny model on CPU to check the
script end to end (no bound is reported there unless `--peak-bw-tbs` is given).

    python benchmarks/decode.py --model qwen3_1_7b \
        --account benchmarks/accounts/rl_step_qwen3_1_7b.json --json decode.json   # GPU
    python benchmarks/decode.py --smoke --json /tmp/decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Sequence

# Peak HBM bandwidth in TB/s by a substring of the device name (most specific first).
PEAK_BW_TBS = (("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35),
               ("A100-SXM4-80GB", 2.039), ("A100", 1.555))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma2b", help="preset of configs/model/ (random weights)")
    p.add_argument("--dtype", default="bfloat16", help="compute and parameter dtype")
    p.add_argument("--batch", type=int, default=256, help="rows decoded together")
    p.add_argument("--prompt-tokens", type=int, default=960, help="prompt length of every row")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per length (median)")
    p.add_argument("--peak-bw-tbs", type=float, default=None,
                   help="peak memory bandwidth in TB/s; default: from the GPU's name")
    p.add_argument("--block-size", type=int, default=64, help="rollout.block_size")
    p.add_argument("--account", default=None,
                   help="a `gpurl plan plan.json` of a run whose decode step to compare with")
    p.add_argument("--sampling-layers", default="auto", choices=["auto", "scan", "unrolled"],
                   help="model.sampling_layers (auto: unrolled on accelerators, a scan on CPU)")
    p.add_argument("--smoke", "--cpu-smoke", action="store_true",
                   help="tiny model, batch 8, 24 + 8 tokens, on CPU: checks the script runs")
    p.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "gpurl_decode.json"))
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (the first token comes from the prefill).")
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        args.model, args.dtype, args.batch, args.block_size = "tiny", "float32", 8, 8
        args.prompt_tokens, args.new_tokens, args.repeats = 24, 8, 2
        args.sampling_layers = "unrolled"  # the accelerators' layout, so the smoke run covers it
    return args


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def peak_bandwidth(args: argparse.Namespace, name: str | None) -> float | None:
    """Bytes per second, or None when unknown."""
    if args.peak_bw_tbs:
        return args.peak_bw_tbs * 1e12
    for key, tbs in PEAK_BW_TBS:
        if name and key in name:
            return tbs * 1e12
    return None


def model_config(args: argparse.Namespace):
    import yaml

    from gpurl.config import ModelConfig

    path = Path(__file__).resolve().parent.parent / "configs/model" / f"{args.model}.yaml"
    values = yaml.safe_load(path.read_text())
    values.update(dtype=args.dtype, param_dtype=args.dtype, checkpoint=None,
                  sampling_layers=args.sampling_layers,
                  max_seq_len=max(values.get("max_seq_len", 0),
                                  args.prompt_tokens + args.new_tokens))
    fields = ModelConfig.__dataclass_fields__
    # PyYAML reads 1e-06 as a string (YAML 1.1); Hydra's loader does not.
    values = {k: float(v) if isinstance(fields[k].default, float) and isinstance(v, str) else v
              for k, v in values.items() if k in fields and k != "lora"}
    return ModelConfig(**values)


def build(args: argparse.Namespace):
    """(engine, params in its sampling layout, model spec) with random weights."""
    import jax

    from gpurl.config import MeshConfig, RolloutConfig
    from gpurl.distributed.mesh import rollout_mesh
    from gpurl.models import model_spec
    from gpurl.rollout.engine import Engine

    spec, mesh_cfg = model_spec(model_config(args)), MeshConfig()
    rollout = RolloutConfig(max_new_tokens=args.new_tokens, temperature=args.temperature,
                            slots=args.batch, block_size=args.block_size)
    engine = Engine(spec, rollout, rollout_mesh(mesh_cfg), mesh_cfg.sample_rules, stop_ids=(),
                    pad_id=0)
    # Created in the stored layout (stacked layers), then put in the sampling layout once
    # (unrolled layers on accelerators), so the timed calls convert nothing.
    stored = jax.jit(spec.init, static_argnums=0, out_shardings=engine.stacked_shardings)(0)
    return engine, engine.place(stored), spec


def kv_bytes_per_token(spec: Any) -> int:
    """K and V bytes of one position of one row, over all layers."""
    import jax

    from gpurl.models import init_cache

    cache = jax.eval_shape(lambda: init_cache(spec.cfg, 1, 1))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))


def gpu_target(device: str | None) -> Any:
    """The `gpurl.plan.targets` GPU of that name (nvidia-smi's: "NVIDIA H100 80GB HBM3",
    "NVIDIA H200"), or None: a variant (PCIe, NVL) has other peaks."""
    from gpurl.plan.targets import GPUS

    return next((g for g in GPUS.values() if g.description == device), None)


def account_step(path: str, device: str | None, contexts: list[int]) -> dict[str, Any]:
    """The decode step of an account (`gpurl plan plan.json`): its unit, and its roofline
    seconds at the mean of `contexts` (its live KV cache's bytes scaled from the unit's
    full context; no sliding window in the presets measured) on the GPU measured when that
    GPU is a known one, else on the GPU it was compiled for."""
    plan = json.loads(Path(path).read_text())
    step = next(p for p in plan["rl_step"]["programs"] if p["program"] == "rollout decode chunk")
    gpu = gpu_target(device)
    peak, bandwidth = ((gpu.bf16_flops, gpu.bandwidth) if gpu else
                       (plan["target_peak"]["bf16_flops"], plan["target_peak"]["bandwidth"]))
    share = statistics.mean(contexts) / plan["rl_step"]["length"]
    bytes_ = step["bytes"] - step["kv_bytes"] * (1.0 - share)
    return {"unit": step["unit"], "seconds": max(step["flops"] / peak, bytes_ / bandwidth),
            "on": gpu.description if gpu else plan["target"]}


def one_call(engine: Any, params: Any, prompts: list[list[int]], args: argparse.Namespace,
             seed: int) -> dict[str, float]:
    """The engine's statistics of one generation of every prompt."""
    from gpurl.rollout.requests import Request

    requests = [Request(tuple(p), args.new_tokens, args.temperature, seed=seed * len(prompts) + i)
                for i, p in enumerate(prompts)]
    done = engine.generate(params, requests)  # completions on the host: the work is done
    if any(len(c.tokens) != args.new_tokens for c in done):
        raise SystemExit("decode: a row stopped early; the engine was built without stop ids.")
    return dict(engine.stats)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    import jax
    import numpy as np

    from gpurl.models import count_params

    name = gpu_name() if jax.default_backend() == "gpu" else None
    engine, params, spec = build(args)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, spec.cfg.vocab_size, (args.batch, args.prompt_tokens)).tolist()
    one_call(engine, params, prompts, args, 0)  # compiles
    calls = [one_call(engine, params, prompts, args, r + 1) for r in range(args.repeats)]
    steps = int(calls[0]["steps"])
    decode_s = statistics.median(c["decode_s"] for c in calls)
    decoded = args.batch * steps
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_token = kv_bytes_per_token(spec)
    # The prefill samples the first token; decode step t (1..steps) attends over the prompt
    # and the t tokens before it.
    contexts = [args.prompt_tokens + t for t in range(1, steps + 1)]
    bytes_read = sum(param_bytes + args.batch * c * kv_token for c in contexts)
    bw = peak_bandwidth(args, name)
    result: dict[str, Any] = {
        "device": name or jax.devices()[0].device_kind, "backend": jax.default_backend(),
        "model": args.model, "params": count_params(params), "dtype": args.dtype,
        "batch": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "temperature": args.temperature, "sampler": "engine", "decode_steps": steps,
        "prefill_s": round(statistics.median(c["prefill_s"] for c in calls), 4),
        "decode_s": round(decode_s, 4), "decode_tok_s": round(decoded / decode_s, 1),
        "decode_step_ms": round(1e3 * decode_s / steps, 3),
        "param_gb": round(param_bytes / 1e9, 3),
        "kv_gb_read_per_step_mean": round(args.batch * statistics.mean(contexts) * kv_token / 1e9, 3),
        "decode_s_per_call": [c["decode_s"] for c in calls]}
    if bw:
        bound_s = bytes_read / bw
        result.update(peak_bw_tbs=bw / 1e12, bound_tok_s=round(decoded / bound_s, 1),
                      bound_step_ms=round(1e3 * bound_s / steps, 3),
                      fraction_of_bound=round(bound_s / decode_s, 3))
    if args.account:  # the compiler's roofline of the same step, at these contexts
        acc = account_step(args.account, name, contexts)
        result.update(account_unit=acc["unit"], account_on=acc["on"],
                      account_step_ms=round(1e3 * acc["seconds"], 3),
                      account_tok_s=round(args.batch / acc["seconds"], 1),
                      fraction_of_account=round(acc["seconds"] * steps / decode_s, 3))
    print(f"decode {args.model} ({result['params']:,} params, {args.dtype}) on {result['device']}: "
          f"B={args.batch}, prompt {args.prompt_tokens}, {args.new_tokens} new tokens")
    print("| decode tok/s | ms/step | HBM-bound tok/s | fraction of bound | account tok/s | "
          "fraction of account | params GB | KV GB/step | prefill s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {result['decode_tok_s']} | {result['decode_step_ms']} | "
          f"{result.get('bound_tok_s', 'n/a')} | {result.get('fraction_of_bound', 'n/a')} | "
          f"{result.get('account_tok_s', 'n/a')} | {result.get('fraction_of_account', 'n/a')} | "
          f"{result['param_gb']} | {result['kv_gb_read_per_step_mean']} | {result['prefill_s']} |")
    if args.account:
        print(f"account: {result['account_unit']}, roofline {result['account_step_ms']} ms on "
              f"{result['account_on']} ({args.account})")
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

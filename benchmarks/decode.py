"""Decode throughput of gpurl's StaticSampler against the memory-bandwidth bound of the device.

A decode step reads every parameter once and the KV cache of every row up to its current
length, so on a GPU its time is bounded below by (parameter bytes + KV cache bytes read) /
peak HBM bandwidth. This script times the StaticSampler (one jitted prefill + decode loop) on
random weights of a preset (gemma2b by default, bf16), every row running to exactly
`--new-tokens` tokens (no stop ids), and reports decode tokens/s and its fraction of that
bound. Decode time is separated from the prefill by timing the same call with 1 and with
`--new-tokens` new tokens: decode s = t(N) - t(1), for B x (N - 1) tokens. Each timing is
the median of `--repeats` calls after a compiling call.

Peak bandwidth comes from the GPU's name (nvidia-smi; H200 4.8 TB/s, H100 SXM 3.35 TB/s)
or `--peak-bw-tbs`. `--smoke` (alias `--cpu-smoke`) runs a tiny model on CPU to check the
script end to end (no bound is reported there unless `--peak-bw-tbs` is given).

    python benchmarks/decode.py --model gemma2b --batch 256 --json decode.json   # GPU
    python benchmarks/decode.py --smoke --json /tmp/decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
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
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of every row")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per length (median)")
    p.add_argument("--peak-bw-tbs", type=float, default=None,
                   help="peak memory bandwidth in TB/s; default: from the GPU's name")
    p.add_argument("--sampling-layers", default="auto", choices=["auto", "scan", "unrolled"],
                   help="model.sampling_layers (auto: unrolled on accelerators, a scan on CPU)")
    p.add_argument("--smoke", "--cpu-smoke", action="store_true",
                   help="tiny model, batch 8, 8 + 8 tokens, on CPU: checks the script runs")
    p.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "gpurl_decode.json"))
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (decode time = t(N) - t(1)).")
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        args.model, args.dtype, args.batch = "tiny", "float32", 8
        args.prompt_tokens, args.new_tokens, args.repeats = 8, 8, 2
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
    """(sampler, params on the rollout mesh, model spec) with random weights."""
    import jax

    from gpurl.config import MeshConfig, RolloutConfig
    from gpurl.distributed.mesh import rollout_mesh
    from gpurl.models import model_spec
    from gpurl.rollout.static import StaticSampler

    spec, mesh_cfg = model_spec(model_config(args)), MeshConfig()
    mesh = rollout_mesh(mesh_cfg)
    sampler = StaticSampler(spec, RolloutConfig(top_k=0, top_p=1.0, max_new_tokens=args.new_tokens),
                      mesh, mesh_cfg.sample_rules, stop_ids=(), pad_id=0)
    # Created in the stored layout (stacked layers), then put in the sampling layout once
    # (unrolled layers on accelerators), so the timed calls convert nothing.
    stored = jax.jit(spec.init, static_argnums=0, out_shardings=sampler.stacked_shardings)(0)
    return sampler, sampler.place(stored), spec


def kv_bytes_per_token(spec: Any) -> int:
    """K and V bytes of one position of one row, over all layers."""
    import jax

    from gpurl.models import init_cache

    cache = jax.eval_shape(lambda: init_cache(spec.cfg, 1, 1))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))


def time_calls(sampler: Any, params: Any, prompts: list[list[int]], new: int,
               temperature: float, repeats: int) -> tuple[float, list[float]]:
    """(first call s: compile + run, timed calls s)."""
    import jax

    def call(seed: int) -> float:
        t0 = time.perf_counter()
        out = sampler.generate(params, prompts, [seed * len(prompts) + i for i in range(len(prompts))],
                               new, temperature)
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    first = call(0)
    return first, [call(r + 1) for r in range(repeats)]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    import jax
    import numpy as np

    from gpurl.models import count_params

    name = gpu_name() if jax.default_backend() == "gpu" else None
    sampler, params, spec = build(args)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, spec.cfg.vocab_size, (args.batch, args.prompt_tokens)).tolist()
    first_1, times_1 = time_calls(sampler, params, prompts, 1, args.temperature, args.repeats)
    first_n, times_n = time_calls(sampler, params, prompts, args.new_tokens, args.temperature,
                                  args.repeats)
    t1, tn = statistics.median(times_1), statistics.median(times_n)
    if tn <= t1:  # tiny smoke sizes: the decode loop is lost in the timing noise
        print(f"decode time not resolved: t({args.new_tokens}) {tn:.4f} s <= t(1) {t1:.4f} s; "
              "figures below use t(N) alone")
    decode_s = tn - t1 if tn > t1 else tn
    decoded = args.batch * (args.new_tokens - 1)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_token = kv_bytes_per_token(spec)
    # Step t (1..N-1) attends over the prompt and the t tokens before it.
    contexts = [args.prompt_tokens + t for t in range(1, args.new_tokens)]
    bytes_read = sum(param_bytes + args.batch * c * kv_token for c in contexts)
    bw = peak_bandwidth(args, name)
    result: dict[str, Any] = {
        "device": name or jax.devices()[0].device_kind, "backend": jax.default_backend(),
        "model": args.model, "params": count_params(params), "dtype": args.dtype,
        "batch": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "temperature": args.temperature, "prefill_plus_1_s": round(t1, 4),
        "total_s": round(tn, 4), "compile_s": round(first_n - tn, 2),
        "decode_s": round(decode_s, 4), "decode_tok_s": round(decoded / decode_s, 1),
        "decode_step_ms": round(1e3 * decode_s / (args.new_tokens - 1), 3),
        "param_gb": round(param_bytes / 1e9, 3),
        "kv_gb_read_per_step_mean": round(args.batch * statistics.mean(contexts) * kv_token / 1e9, 3),
        "times_1_s": times_1, "times_n_s": times_n}
    if bw:
        bound_s = bytes_read / bw
        result.update(peak_bw_tbs=bw / 1e12, bound_tok_s=round(decoded / bound_s, 1),
                      bound_step_ms=round(1e3 * bound_s / (args.new_tokens - 1), 3),
                      fraction_of_bound=round(bound_s / decode_s, 3))
    print(f"decode {args.model} ({result['params']:,} params, {args.dtype}) on {result['device']}: "
          f"B={args.batch}, prompt {args.prompt_tokens}, {args.new_tokens} new tokens")
    print("| decode tok/s | ms/step | HBM-bound tok/s | fraction of bound | params GB | "
          "KV GB/step | prefill+1 s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {result['decode_tok_s']} | {result['decode_step_ms']} | "
          f"{result.get('bound_tok_s', 'n/a')} | {result.get('fraction_of_bound', 'n/a')} | "
          f"{result['param_gb']} | {result['kv_gb_read_per_step_mean']} | {result['prefill_plus_1_s']} |")
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

"""Decode throughput of the rollout engine on an accelerator, against the HBM bound.

A preset with random weights (default `gemma2b`, bf16), `--batch` requests of
`--prompt-tokens` prompt tokens each decoding exactly `--new-tokens` (no stop ids), all
in flight at once (`rollout.slots = batch`). Tokens/s is over the whole `generate` call
(one batched prefill of the short prompts, then the decode chunks). The bound: each decode step reads
every parameter once and each row's KV cache up to its length, so at the device's
bandwidth a step takes at least (parameter bytes + KV bytes read) / bandwidth; the
fraction is measured tokens/s over the bound's. The H200's HBM3e moves 4.8 TB/s (NVIDIA's
H200 datasheet); pass `--hbm-gbps` for another device.

    python benchmarks/rollout_gpu.py                      # on the GPU machine
    python benchmarks/rollout_gpu.py --smoke              # tiny model on CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Sequence

import jax
import numpy as np

from decode import model_config  # (benchmarks/decode.py: a preset's fields, random weights)
from gpurl.config import MeshConfig, RolloutConfig
from gpurl.distributed.mesh import rollout_mesh
from gpurl.models import model_spec
from gpurl.rollout.engine import Engine
from gpurl.rollout.requests import Request


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma2b", help="a model preset (random weights)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--sampling-layers", default="auto", choices=["auto", "scan", "unrolled"],
                   help="model.sampling_layers (auto: unrolled on accelerators, a scan on CPU)")
    p.add_argument("--hbm-gbps", type=float, default=4800.0, help="device memory bandwidth, GB/s")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on CPU, in seconds: checks the script end to end")
    args = p.parse_args(argv)
    if args.smoke:  # unrolled: the accelerators' layout, so the smoke run covers it
        args.model, args.dtype, args.batch, args.prompt_tokens = "tiny", "float32", 4, 8
        args.new_tokens, args.block_size, args.sampling_layers, args.repeats = 8, 8, "unrolled", 1
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # the preset's architecture (a bare ModelConfig(name=...) would be the defaults' tiny one)
    cfg = model_config(args)
    spec, mesh_cfg = model_spec(cfg), MeshConfig()
    rollout = RolloutConfig(max_new_tokens=args.new_tokens, temperature=0.0, slots=args.batch,
                            block_size=args.block_size, decode_chunk=32)
    engine = Engine(spec, rollout, rollout_mesh(mesh_cfg), mesh_cfg.sample_rules, stop_ids=(),
                    pad_id=0)
    # stored layout (stacked layers) first, then the sampling layout once (unrolled on GPUs)
    params = engine.place(jax.jit(lambda: spec.init(0), out_shardings=engine.stacked_shardings)())
    rng = np.random.default_rng(0)
    requests = [Request(tuple(rng.integers(3, cfg.vocab_size, args.prompt_tokens).tolist()),
                        args.new_tokens, 0.0, seed=i) for i in range(args.batch)]
    engine.generate(params, requests)  # compiles
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        done = engine.generate(params, requests)
        times.append(time.perf_counter() - t0)
        assert all(len(c.tokens) == args.new_tokens for c in done)
    seconds = float(np.median(times))
    tokens = args.batch * args.new_tokens
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    per_token_kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(args.dtype).itemsize
    mean_len = args.prompt_tokens + args.new_tokens / 2
    step_bytes = param_bytes + args.batch * mean_len * per_token_kv
    bound = args.batch / (step_bytes / (args.hbm_gbps * 1e9))
    out = {"model": args.model, "dtype": args.dtype, "batch": args.batch,
           "device": str(jax.devices()[0]), "seconds": round(seconds, 3),
           "tokens_per_s": round(tokens / seconds, 1), "hbm_bound_tokens_per_s": round(bound, 1),
           "fraction_of_bound": round(tokens / seconds / bound, 3),
           "parameter_gb": round(param_bytes / 1e9, 2), "engine": engine.stats}
    print("| model | dtype | batch | decode tok/s | HBM bound tok/s | fraction |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    print(f"| {args.model} | {args.dtype} | {args.batch} | {out['tokens_per_s']:.0f} | "
          f"{bound:.0f} | {out['fraction_of_bound']:.2f} |")
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

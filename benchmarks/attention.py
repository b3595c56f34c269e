"""TFLOP/s of each attention implementation (`gpurl.kernels.attention`): forward,
forward + backward (training) and one decode step against a KV cache.

Defaults are `gemma2b`'s attention (8 query heads, 1 kv head, head width 256) in bf16 at
4 x 4,096 tokens, causal, sized for one GPU in well under 5 minutes. FLOPs count only
visible (query, key) pairs: 4 x D per pair forward (two matmuls), 2.5x that backward
(five matmuls: FlashAttention-2's convention), so a kernel that skips masked blocks is
not credited for work it does not do. `xla` computes every pair; its TFLOP/s is
therefore the useful fraction of what it spends. Time is the median of `--repeats`
calls after one warm-up. On CPU, Pallas runs in its interpreter, so use small shapes:

    python benchmarks/attention.py                                   # GPU
    python benchmarks/attention.py --batch 1 --seq 256 --cache 512 --head-dim 64 --json a.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gpurl.kernels import attention as attn


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096, help="T = S of the training cases")
    p.add_argument("--cache", type=int, default=8192, help="S of the decode case (T = 1)")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--window", type=int, default=0, help="sliding window; 0 = causal only")
    p.add_argument("--softcap", type=float, default=0.0, help="logit soft-cap; 0 = none")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impls", default="", help="comma-separated; empty = every one this "
                   "platform runs (cudnn only on GPUs)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="", help="also write the rows and settings here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on CPU, in seconds: checks the script end to end")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.seq, args.cache, args.decode_batch = 1, 32, 64, 2
        args.heads, args.kv_heads, args.head_dim, args.dtype, args.repeats = 2, 1, 16, "float32", 1
    return args


def visible_pairs(t: int, s: int, window: int) -> int:
    """(query, key) pairs the mask keeps, queries at the last t of s positions."""
    q_pos = np.arange(s - t, s)
    seen = q_pos + 1 if not window else np.minimum(q_pos + 1, window)
    return int(seen.sum())


def timed(fn: Callable[..., Any], args: Sequence[Any], repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cases(args: argparse.Namespace, impl: str):
    """(mode, jitted fn, arguments, FLOPs) for training forward, fwd+bwd and decode."""
    dt = jnp.dtype(args.dtype)
    kw = dict(scale=args.head_dim ** -0.5, softcap=args.softcap or None,
              window=args.window or None, implementation=impl)
    key = jax.random.key(0)

    def qkv(b, t, s):
        kq, kk, kv = jax.random.split(key, 3)
        return (jax.random.normal(kq, (b, t, args.heads, args.head_dim), dt),
                jax.random.normal(kk, (b, s, args.kv_heads, args.head_dim), dt),
                jax.random.normal(kv, (b, s, args.kv_heads, args.head_dim), dt))

    b, t = args.batch, args.seq
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seg = jnp.ones((b, t), jnp.int32)
    fwd_flops = 4 * b * args.heads * args.head_dim * visible_pairs(t, t, args.window)

    def forward(q, k, v):
        return attn.attention(q, k, v, pos, seg, pos, seg, contiguous=True, **kw)

    def train(q, k, v):
        return jax.grad(lambda *x: forward(*x).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)

    yield "forward", jax.jit(forward), qkv(b, t, t), fwd_flops
    yield "fwd+bwd", jax.jit(train), qkv(b, t, t), 3.5 * fwd_flops
    b, s = args.decode_batch, args.cache
    kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    q_pos = kv_pos[:, -1:]

    def decode(q, k, v):
        return attn.attention(q, k, v, q_pos, jnp.ones((b, 1), jnp.int32), kv_pos,
                              jnp.ones((b, s), jnp.int32), **kw)

    yield "decode", jax.jit(decode), qkv(b, 1, s), (
        4 * b * args.heads * args.head_dim * visible_pairs(1, s, args.window))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    impls = [i for i in args.impls.split(",") if i] or (
        ["xla", "cudnn", "pallas"] if on_gpu else ["xla", "pallas"])
    rows = []
    for impl in impls:
        for mode, fn, fn_args, flops in cases(args, impl):
            try:
                seconds = timed(fn, fn_args, args.repeats)
                rows.append({"impl": impl, "mode": mode, "median_s": seconds,
                             "tflops": flops / seconds / 1e12})
            except Exception as e:  # e.g. out of memory for xla's T x S logits
                rows.append({"impl": impl, "mode": mode, "median_s": None, "tflops": None,
                             "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
            print(rows[-1], flush=True)
    print("\n| implementation | mode | median ms | TFLOP/s |\n| --- | --- | ---: | ---: |")
    for r in rows:
        ms = "failed" if r["median_s"] is None else f"{1e3 * r['median_s']:.2f}"
        tf = "" if r["tflops"] is None else f"{r['tflops']:.4f}"
        print(f"| {r['impl']} | {r['mode']} | {ms} | {tf} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows, "device": str(jax.devices()[0]),
                       "jax": jax.__version__, "host": platform.node(),
                       "date": datetime.date.today().isoformat()}, f, indent=1)


if __name__ == "__main__":
    main()

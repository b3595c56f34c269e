"""Memory and time of token log-probabilities, forward + backward: whole logits against
chunks (`gpurl.kernels.logprob`), at Gemma 3's head (V = 262,144, D = 640 by default).

Each case is `jax.value_and_grad` of the mean log-probability of N random target tokens
(B rows of N / B tokens) with respect to the head weight V x D and the hidden states
B x T x D, under `jax.jit`. Memory comes from XLA's analysis of the compiled program
(`compiled.memory_analysis()`), so nothing is allocated for it and cases far larger than
this machine's memory are still measured: `temp` is XLA's scratch memory for intermediate
arrays, `peak` adds arguments and outputs (the weight, its gradient, the hidden states).
A forward-only `temp` (log-probabilities of an old or reference policy) is reported too.
A case runs (after one untimed warm-up call) only when its `peak` fits under
`--max-run-gb`; the time is the median of `--repeats` calls.

    python benchmarks/logprobs.py --tokens 2048,8192 --chunk-sizes 256,1024 --json out.json
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

from gpurl.kernels.logprob import (chunked_token_logprobs, default_chunk_size,
                                   token_logprobs_reference)

GB = 1e9


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=262144, help="V (Gemma 3: 262,144)")
    p.add_argument("--dim", type=int, default=640, help="D (Gemma 3 270M: 640)")
    p.add_argument("--rows", type=int, default=8, help="B; each case has N / B tokens per row")
    p.add_argument("--tokens", default="2048,8192", help="comma-separated N = B x T")
    p.add_argument("--chunk-sizes", default="", help="comma-separated chunk sizes in tokens; "
                   "empty = the default for V")
    p.add_argument("--dtype", default="float32", help="hidden states and head weight")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per case (median)")
    p.add_argument("--max-run-gb", type=float, default=8.0,
                   help="run (time) a case only if its analysed peak fits under this")
    p.add_argument("--json", default="", help="also write the rows and settings here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on CPU, in seconds: checks the script end to end")
    args = p.parse_args(argv)
    if args.smoke:
        args.vocab, args.dim, args.rows, args.tokens, args.repeats = 512, 32, 2, "64", 1
        args.chunk_sizes = "16"  # several chunks: the loop runs
    return args


def head(w_VxD: jax.Array, hidden_NxD: jax.Array) -> jax.Array:
    """Gemma's tied output head."""
    return jnp.einsum("...d,vd->...v", hidden_NxD, w_VxD)


def loss_fn(impl: Callable[..., Any], **kw: Any) -> Callable[..., jax.Array]:
    def loss(w_VxD: jax.Array, hidden_BxTxD: jax.Array, targets_BxT: jax.Array) -> jax.Array:
        return impl(head, w_VxD, hidden_BxTxD, targets_BxT, **kw)[0].mean()
    return loss


def measure(name: str, loss: Callable[..., jax.Array], n: int,
            args: argparse.Namespace) -> dict[str, Any]:
    dtype = jnp.dtype(args.dtype)
    shapes = (jax.ShapeDtypeStruct((args.vocab, args.dim), dtype),
              jax.ShapeDtypeStruct((args.rows, n // args.rows, args.dim), dtype),
              jax.ShapeDtypeStruct((args.rows, n // args.rows), jnp.int32))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    start = time.perf_counter()
    compiled = step.lower(*shapes).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    fwd = jax.jit(loss).lower(*shapes).compile().memory_analysis()
    peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)
    row = {"impl": name, "tokens": n, "temp_gb": mem.temp_size_in_bytes / GB,
           "peak_gb": peak / GB, "fwd_temp_gb": fwd.temp_size_in_bytes / GB,
           "compile_s": compile_s, "median_s": None}
    if peak / GB <= args.max_run_gb:
        row["median_s"] = statistics.median(timed(compiled, shapes, args.repeats))
    return row


def timed(compiled: Any, shapes: Sequence[jax.ShapeDtypeStruct], repeats: int) -> list[float]:
    k_w, k_h, k_t = jax.random.split(jax.random.key(0), 3)
    w_VxD = (jax.random.normal(k_w, shapes[0].shape) * 0.05).astype(shapes[0].dtype)
    hidden = jax.random.normal(k_h, shapes[1].shape).astype(shapes[1].dtype)
    targets = jax.random.randint(k_t, shapes[2].shape, 0, shapes[0].shape[0])
    jax.block_until_ready(compiled(w_VxD, hidden, targets))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(w_VxD, hidden, targets))
        times.append(time.perf_counter() - start)
    del w_VxD, hidden
    return times


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| tokens | implementation | fwd+bwd temp GB | fwd+bwd peak GB | fwd temp GB "
          "| median s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        t = "not run" if r["median_s"] is None else f"{r['median_s']:.2f}"
        print(f"| {r['tokens']} | {r['impl']} | {r['temp_gb']:.3f} | {r['peak_gb']:.3f} "
              f"| {r['fwd_temp_gb']:.3f} | {t} |")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    chunks = [int(c) for c in args.chunk_sizes.split(",") if c] or [default_chunk_size(args.vocab)]
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        if n % args.rows:
            raise SystemExit(f"--tokens {n} is not a multiple of --rows {args.rows}; "
                             "choose token counts that split evenly into rows.")
        cases = [("reference", loss_fn(token_logprobs_reference))]
        cases += [(f"chunked {c}", loss_fn(chunked_token_logprobs, chunk_size=c)) for c in chunks]
        for name, loss in cases:
            rows.append(measure(name, loss, n, args))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    if args.json:
        env = {"backend": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
               "jax": jax.__version__, "python": platform.python_version(),
               "date": datetime.date.today().isoformat()}
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "environment": env, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

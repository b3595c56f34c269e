"""Train-step throughput and MFU of a `gemma2b`-sized model (random weights) in bf16.

One step = forward, chunked next-token log-probs over the vocabulary
(`gpurl.kernels.logprob`), backward and an SGD update, jitted with the parameters
donated; it is the work of an SFT step or of the policy pass of an RL step (no optimizer
moments, no rollout). MFU = model FLOPs per second / the measured bf16 matmul ceiling
(a square `--matmul` matmul on the same device), where model FLOPs = 6 x (matmul
parameters incl. the output head) x tokens + 3 x the forward FLOPs of attention's
visible (query, key) pairs (4 x D each). Time is the median of `--repeats` steps after
one warm-up step, for each `--attention` implementation.

    python benchmarks/train_step.py                                  # GPU, < 5 minutes
    python benchmarks/train_step.py --layers 2 --d-model 256 --heads 4 --head-dim 64 \\
        --mlp 1024 --vocab 4096 --batch 2 --seq 128 --matmul 1024 --attention xla,pallas
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import yaml

from gpurl.config import ModelConfig
from gpurl.kernels.logprob import chunked_token_logprobs
from gpurl.models import model_spec

PRESET = Path(__file__).resolve().parents[1] / "configs" / "model" / "gemma2b.yaml"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=0, help="override the preset; 0 = keep")
    p.add_argument("--d-model", type=int, default=0)
    p.add_argument("--heads", type=int, default=0)
    p.add_argument("--kv-heads", type=int, default=0)
    p.add_argument("--head-dim", type=int, default=0)
    p.add_argument("--mlp", type=int, default=0)
    p.add_argument("--vocab", type=int, default=0)
    p.add_argument("--attention", default="auto", help="comma-separated model.attention values")
    p.add_argument("--matmul", type=int, default=8192, help="side of the ceiling matmul")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="", help="also write the rows and settings here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on CPU, in seconds: checks the script end to end")
    args = p.parse_args(argv)
    if args.smoke:  # benchmarks/gpu.sh --cpu-smoke's sizes, smaller
        args.layers, args.d_model, args.heads, args.kv_heads, args.head_dim = 2, 64, 4, 1, 16
        args.mlp, args.vocab, args.batch, args.seq, args.matmul = 128, 512, 2, 32, 64
        args.repeats, args.attention = 1, "xla"
    return args


def model_config(args: argparse.Namespace, attention: str) -> ModelConfig:
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    # PyYAML reads 1e-06 as a string (YAML 1.1); Hydra's loader does not.
    fields = {k: float(v) if isinstance(defaults[k], float) else v
              for k, v in yaml.safe_load(PRESET.read_text()).items() if k in defaults}
    overrides = {"num_layers": args.layers, "d_model": args.d_model, "num_heads": args.heads,
                 "num_kv_heads": args.kv_heads, "head_dim": args.head_dim,
                 "mlp_dim": args.mlp, "vocab_size": args.vocab}
    fields.update({k: v for k, v in overrides.items() if v})
    fields.update(dtype="bfloat16", param_dtype="bfloat16", attention=attention,
                  max_seq_len=args.seq)
    return ModelConfig(**fields)


def model_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    d, h, k, e = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = d * e * (2 * h + 2 * k) + 3 * d * cfg.mlp_dim
    matmul_params = cfg.num_layers * per_layer + cfg.vocab_size * d
    pairs = seq * (seq + 1) // 2  # causal, no window
    attention = cfg.num_layers * 4 * batch * h * e * pairs
    return 6.0 * matmul_params * batch * seq + 3.0 * attention


def median_time(fn, args: tuple, repeats: int, donated: bool) -> tuple[float, Any]:
    out = fn(*args)  # compile + warm-up
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        if donated:
            args = (out,) + args[1:]
        start = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def matmul_ceiling(n: int, repeats: int) -> float:
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    seconds, _ = median_time(jax.jit(lambda a: a @ a), (a,), repeats, donated=False)
    return 2 * n**3 / seconds / 1e12


def step_time(cfg: ModelConfig, args: argparse.Namespace) -> float:
    spec = model_spec(cfg)
    params = jax.jit(lambda: spec.init(0))()
    tokens = jax.random.randint(jax.random.key(2), (args.batch, args.seq), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(args.seq, dtype=jnp.int32), tokens.shape)
    segments = jnp.ones_like(tokens)

    def loss(params, tokens):
        hidden_BxTxD, _ = spec.hidden(params, tokens, positions, segments)
        logp_BxT, _ = chunked_token_logprobs(spec.logits, params, hidden_BxTxD[:, :-1],
                                             tokens[:, 1:])
        return -logp_BxT.mean()

    def step(params, tokens):
        grads = jax.grad(loss)(params, tokens)
        return jax.tree.map(lambda p, g: p - (1e-4 * g).astype(p.dtype), params, grads)

    step = jax.jit(step, donate_argnums=0)
    seconds, _ = median_time(step, (params, tokens), args.repeats, donated=True)
    return seconds


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    ceiling = matmul_ceiling(args.matmul, args.repeats)
    print(f"bf16 matmul ceiling ({args.matmul}^3): {ceiling:.3f} TFLOP/s", flush=True)
    rows = []
    for attention in args.attention.split(","):
        cfg = model_config(args, attention)
        seconds = step_time(cfg, args)
        tflops = model_flops(cfg, args.batch, args.seq) / seconds / 1e12
        rows.append({"attention": attention, "median_s": seconds,
                     "tokens_per_s": args.batch * args.seq / seconds, "tflops": tflops,
                     "mfu": tflops / ceiling})
        print(rows[-1], flush=True)
    print("\n| attention | step s | tokens/s | model TFLOP/s | MFU vs matmul ceiling |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['attention']} | {r['median_s']:.3f} | {r['tokens_per_s']:.0f} "
              f"| {r['tflops']:.4f} | {r['mfu']:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "matmul_tflops": ceiling, "rows": rows,
                       "device": str(jax.devices()[0]), "jax": jax.__version__,
                       "host": platform.node(), "date": datetime.date.today().isoformat()},
                      f, indent=1)


if __name__ == "__main__":
    main()

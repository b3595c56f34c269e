"""Mixture-of-experts: train-step throughput against the dense model of the same active
size, the grouped matmul's implementations, and routing replay's effect on the
sampler-vs-trainer log-prob gap in bf16.

    python benchmarks/moe.py steps --repeats 5 --json moe_steps.json   # ~3 min on 2 cores
    python benchmarks/moe.py replay --steps 4 --json moe_replay.json   # ~2 min
    python benchmarks/moe.py kernel --json moe_kernel.json             # GPU: ~1 min
    python benchmarks/moe.py --smoke     # all three at tiny sizes (replay: 2 steps): the script runs

`steps`: one SFT train step (forward, next-token loss, backward; no optimizer) of a small
decoder whose MLPs are 16 experts of width 256 with 2 per token (active MLP width 512)
beside the same decoder with a dense MLP of width 512 (same active parameters), random
weights, fp32 on CPU (the compute dtype gpurl picks there), interleaved, median of the
timed steps after one warm-up. `replay`: `gpurl train algo=grpo model=tiny_moe` in bf16
with model.moe.replay_routing off and on (same seed, so the same first rollout), the
trainer-minus-sampler log-prob gap of the sampled tokens (`mismatch/logprob_abs_mean`) and the
share of replayed expert choices the trainer's router would have made otherwise
(`moe/replay_flips`), per step. `kernel`: the grouped matmul alone (the implementation
`auto` picks here: the Pallas kernels on GPU, the jnp tiles on CPU, and `ragged_dot`),
forward and forward + both gradients, bf16 on GPU (fp32 on CPU), at decode and train
sizes of `qwen3_30b_a3b`'s experts on one device (D 2048, F 768, 16 experts, random
group sizes), against one dense matmul of the same useful flops: TFLOP/s of useful work
and the share of the dense matmul's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from distributed import xla_flags  # (benchmarks/distributed.py: a child's host devices)
from gpurl.config import ModelConfig, MoEConfig
from gpurl.models import model_spec

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(family="qwen3_moe", vocab_size=4096, d_model=256, num_layers=4, num_heads=4,
            num_kv_heads=2, head_dim=64, activation="silu", norm_plus_one=False,
            scale_embeddings=False, qk_norm=True, tie_embeddings=True, dtype="float32",
            remat="none")


SMOKE_BASE = {**BASE, "vocab_size": 256, "d_model": 32, "num_layers": 1, "head_dim": 8}


def _models(experts: int, top_k: int, expert_width: int,
            base: dict[str, Any] = BASE) -> dict[str, ModelConfig]:
    active = top_k * expert_width
    moe = ModelConfig(**base, mlp_dim=active,
                      moe=MoEConfig(num_experts=experts, experts_per_token=top_k,
                                    expert_mlp_dim=expert_width, aux_loss_coef=0.0))
    return {f"moe {experts}x{expert_width} top-{top_k} (tiled)": moe,
            f"moe {experts}x{expert_width} top-{top_k} (ragged_dot)": dataclasses.replace(
                moe, moe=dataclasses.replace(moe.moe, grouped_matmul="ragged")),
            f"dense mlp {active}": dataclasses.replace(moe, family="qwen3", moe=MoEConfig())}


def _step(cfg: ModelConfig, batch: int, seq: int):
    spec = model_spec(cfg)
    params = jax.jit(lambda: spec.init(0))()
    tokens = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    segments = jnp.ones((batch, seq), jnp.int32)

    def loss(p):
        logits = spec.apply(p, tokens, positions, segments)[:, :-1].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    grad = jax.jit(jax.value_and_grad(loss))
    return lambda: jax.block_until_ready(grad(params))


def run_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    configs = _models(args.experts, args.top_k, args.expert_width, getattr(args, "base", BASE))
    steps = {}
    for name, cfg in configs.items():
        t0 = time.perf_counter()
        steps[name] = _step(cfg, args.batch, args.seq)
        steps[name]()
        print(f"compiled {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict[str, list[float]] = {n: [] for n in steps}
    for _ in range(args.repeats):  # interleaved
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    dense = statistics.median(times[next(n for n in times if n.startswith("dense"))])
    rows = []
    for name, ts in times.items():
        s = statistics.median(ts)
        rows.append({"model": name, "step_s": s, "tokens_per_s": tokens / s, "vs_dense": dense / s})
    print(f"\n| model ({args.batch} x {args.seq} tokens, fp32) | step s | tokens/s | vs dense |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {r['vs_dense']:.2f} |")
    return rows


def _timed(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_kernel(args: argparse.Namespace) -> list[dict[str, Any]]:
    from gpurl.kernels.grouped_matmul import grouped_matmul, resolve

    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    d, f, experts = args.d_model, args.expert_width, args.experts
    impls = [resolve("auto"), "ragged"]
    rows = []
    for rows_n in args.rows:
        key = jax.random.key(rows_n)
        x = jax.random.normal(key, (rows_n, d), dtype)
        w = (jax.random.normal(jax.random.fold_in(key, 1), (experts, d, f)) / d ** 0.5).astype(dtype)
        cuts = jnp.sort(jax.random.randint(jax.random.fold_in(key, 2), (experts - 1,), 0, rows_n + 1))
        sizes = jnp.diff(jnp.concatenate([jnp.zeros(1, cuts.dtype), cuts, jnp.full(1, rows_n, cuts.dtype)]))
        dense_w = w[0]
        useful = 2.0 * rows_n * d * f
        programs = {"dense matmul": (lambda x, w, s: x @ dense_w, lambda x, w, s: jax.grad(
            lambda x, w: (x @ w).astype(jnp.float32).sum(), (0, 1))(x, dense_w))}
        for impl in impls:
            programs[impl] = (
                lambda x, w, s, impl=impl: grouped_matmul(x, w, s, impl),
                lambda x, w, s, impl=impl: jax.grad(
                    lambda x, w: grouped_matmul(x, w, s, impl).astype(jnp.float32).sum(), (0, 1))(x, w))
        for pass_name, index, work in (("forward", 0, useful), ("forward + gradients", 1, 3 * useful)):
            dense_s = None
            for name, fns in programs.items():
                s = _timed(jax.jit(fns[index]), (x, w, sizes), args.repeats)
                dense_s = s if name == "dense matmul" else dense_s
                rows.append({"rows": rows_n, "pass": pass_name, "implementation": name, "s": s,
                             "tflops": work / s / 1e12, "vs_dense": dense_s / s})
    print(f"\n| rows | pass | implementation ({jax.default_backend()}, {jnp.dtype(dtype).name}) "
          f"| ms | useful TFLOP/s | vs dense |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['rows']:,} | {r['pass']} | {r['implementation']} | {r['s'] * 1e3:.3f} | "
              f"{r['tflops']:.2f} | {r['vs_dense']:.2f} |")
    return rows


def _grpo(replay: bool, steps: int, new_tokens: int, out: Path) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS=xla_flags(4))
    cmd = [sys.executable, "-m", "gpurl.cli", "train", "algo=grpo", "model=tiny_moe",
           "model.dtype=bfloat16", "model.init_std=0.1", f"model.moe.replay_routing={replay}",
           f"train.steps={steps}", "train.batch_size=4", "train.eval_every=0",
           "train.checkpoint_every=0", "data.num_train=64", "data.num_eval=0",
           f"rollout.max_new_tokens={new_tokens}", "logger.progress=false", f"run.dir={out}"]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_replay(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for replay in (False, True):
            for r in _grpo(replay, args.steps, args.new_tokens, Path(tmp) / str(replay)):
                if "mismatch/logprob_abs_mean" in r:
                    rows.append({"replay": replay, "step": r["step"],
                                 "gap": r["mismatch/logprob_abs_mean"],
                                 "flips": r.get("moe/replay_flips")})
    print("\n| routing replay | step | mean abs(trainer - sampler log-prob) | replayed choices the trainer would flip |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        flips = "-" if r["flips"] is None else f"{r['flips']:.4f}"
        print(f"| {'on' if r['replay'] else 'off'} | {r['step']} | {r['gap']:.5f} | {flips} |")
    for replay in (False, True):
        gaps = [r["gap"] for r in rows if r["replay"] == replay]
        print(f"median gap, replay {'on' if replay else 'off'}: {statistics.median(gaps):.5f}")
    return rows


def smoke() -> None:
    """The three parts at tiny sizes, one after another."""
    ns = argparse.Namespace
    run_steps(ns(experts=4, top_k=2, expert_width=16, batch=2, seq=16, repeats=1, base=SMOKE_BASE))
    run_replay(ns(steps=2, new_tokens=8))
    run_kernel(ns(rows=[64], d_model=32, expert_width=16, experts=4, repeats=1))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="steps, replay and kernel at tiny sizes: checks the script end to end")
    sub = parser.add_subparsers(dest="what")
    steps = sub.add_parser("steps")
    steps.add_argument("--experts", type=int, default=16)
    steps.add_argument("--top-k", type=int, default=2)
    steps.add_argument("--expert-width", type=int, default=256)
    steps.add_argument("--batch", type=int, default=4)
    steps.add_argument("--seq", type=int, default=256)
    steps.add_argument("--repeats", type=int, default=5)
    replay = sub.add_parser("replay")
    replay.add_argument("--steps", type=int, default=4)
    replay.add_argument("--new-tokens", type=int, default=32, help="rollout.max_new_tokens")
    kernel = sub.add_parser("kernel")
    kernel.add_argument("--rows", type=int, nargs="+", default=[512, 16384],
                        help="token copies per call (decode-sized, train-sized)")
    kernel.add_argument("--d-model", type=int, default=2048)
    kernel.add_argument("--expert-width", type=int, default=768)
    kernel.add_argument("--experts", type=int, default=16)
    kernel.add_argument("--repeats", type=int, default=10)
    for p in (steps, replay, kernel):
        p.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    if args.what is None:
        parser.error("name what to run: steps, replay or kernel (or --smoke).")
    rows = {"steps": run_steps, "replay": run_replay, "kernel": run_kernel}[args.what](args)
    if args.json:
        args.json.write_text(json.dumps({
            "rows": rows, "args": {k: str(v) for k, v in vars(args).items()},
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                       f"jax {jax.__version__} ({jax.default_backend()})",
            "date": datetime.date.today().isoformat()}, indent=2))


if __name__ == "__main__":
    main()

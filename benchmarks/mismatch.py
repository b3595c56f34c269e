"""The sampler against the trainer in bf16, before and after the fp32 vocabulary head.

Before: `Transformer.logits` as it was, a matmul in the compute dtype whose bf16 output the
log-prob code cast to fp32 afterwards (patched back in, in-process, for the "bf16 head"
variant). After: gpurl's head, bf16 operands with fp32 accumulation and output
(`preferred_element_type`). Two parts:

- `cpu`: the main job (`gpurl train`, GRPO on the real Gemma 3 270M) in bf16
  (`model.dtype=bfloat16`) on this CPU, both heads interleaved run by run, the same
  seed: per step the mismatch metrics (`mismatch/*`: the sampler's log-probs against the
  trainer's pi_old on the trained tokens) and the train phase's seconds; medians over
  steps and runs.
- `account`: the compiler's account (`gpurl.plan.account`, the text XLA's GPU
  compiler emits for a compile-only H100; the `gpu-plan` extra) of the head's two programs
  at real sizes in bf16, both heads: the trainer's chunked log-probs, forward and backward
  (`chunked_token_logprobs` of 8 x 512 tokens), and a decode step's head and sampling
  (`sample_rows` of 256 rows). Bytes and flops of HBM traffic and the roofline time
  (max of bytes / bandwidth and flops / bf16 peak).

    python benchmarks/mismatch.py cpu --steps 4 --runs 2
    PYTHONPATH=.venv/gpu-compiler python benchmarks/mismatch.py account
    python benchmarks/mismatch.py --smoke   # both parts, the cpu one on the tiny random model
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
HEADS = ("bf16 head", "fp32 head")
MISMATCH = ("mismatch/logprob_abs_mean", "mismatch/logprob_abs_max", "mismatch/k3_kl",
            "mismatch/over_threshold")


@contextlib.contextmanager
def bf16_head(on: bool) -> Iterator[None]:
    """`Transformer.logits` as it was before the fp32 head, while the block runs."""
    import jax.numpy as jnp

    from gpurl.models.transformer import Transformer

    def logits(self, hidden_BxTxD):
        if self.cfg.tie_embeddings:
            out = jnp.einsum("...d,vd->...v", hidden_BxTxD, self.embed[...].astype(self.dtype))
        else:
            out = hidden_BxTxD @ self.lm_head[...].astype(self.dtype)
        if self.cfg.final_softcap is not None:
            cap = self.cfg.final_softcap
            out = cap * jnp.tanh(out.astype(jnp.float32) / cap)
        return out

    fp32 = Transformer.logits
    Transformer.logits = logits if on else fp32
    try:
        yield
    finally:
        Transformer.logits = fp32


# ---------------------------------------------------------------- the main job on CPU

def _run(head: str, steps: int, run_dir: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, __file__, "child", head, "--", "train", "model.dtype=bfloat16",
           f"train.steps={steps}", "data.num_eval=0", "train.checkpoint_every=0",
           "logger.progress=false", f"run.dir={run_dir}", *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def cpu(args: argparse.Namespace) -> dict[str, Any]:
    got: dict[str, list[dict]] = {h: [] for h in HEADS}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for head in (HEADS if run % 2 == 0 else HEADS[::-1]):  # interleaved
                got[head] += _run(head, args.steps, Path(tmp) / f"{head[:4]}-{run}", args.extra)
    table = {}
    print(f"\nThe main job in bf16 on CPU: {args.runs} runs x {args.steps} steps per head, "
          f"medians over steps (the time leaves out each run's first step, which compiles)\n")
    print("| head | " + " | ".join(MISMATCH) + " | time/train_s (steps >= 1) |")
    print("| --- |" + " ---: |" * (len(MISMATCH) + 1))
    for head, rows in got.items():
        row = {k: statistics.median(r[k] for r in rows) for k in MISMATCH}
        row["time/train_s"] = statistics.median(r["time/train_s"] for r in rows if r["step"] > 1)
        table[head] = row
        print(f"| {head} | " + " | ".join(f"{row[k]:.3g}" for k in MISMATCH)
              + f" | {row['time/train_s']:.2f} |")
    a, b = table["bf16 head"], table["fp32 head"]
    print(f"\nfp32 head / bf16 head: mean |delta log p| x{b[MISMATCH[0]] / a[MISMATCH[0]]:.3f}, "
          f"train step time x{b['time/train_s'] / a['time/train_s']:.3f}")
    return table


# ---------------------------------------------------------------- the compiler's account

SIZES = {"gemma3_270m": (262_144, 640), "qwen3_1_7b": (151_936, 2048), "gemma2b": (256_000, 2048)}


def _programs(vocab: int, width: int) -> dict[str, tuple[Any, tuple]]:
    """The trainer's head (value and gradient of the chunked log-probs of 8 x 512 tokens)
    and a decode step's head and sampling (256 rows), as (function, abstract args)."""
    import jax
    import jax.numpy as jnp

    from gpurl.config import ModelConfig
    from gpurl.kernels.logprob import chunked_token_logprobs
    from gpurl.models import model_spec
    from gpurl.rollout.sampling import sample_rows

    cfg = ModelConfig(vocab_size=vocab, d_model=width, num_layers=1, num_heads=8,
                      num_kv_heads=8, head_dim=width // 8, mlp_dim=4 * width, dtype="bfloat16",
                      param_dtype="bfloat16", tie_embeddings=True)
    spec = model_spec(cfg)
    head = {"embed": spec.abstract_params["embed"]}
    full = spec.abstract_params
    sds = jax.ShapeDtypeStruct

    def train(params, hidden_BxTxD, targets_BxT):
        def loss(p, h):
            logp, _ = chunked_token_logprobs(spec.logits, {**full, **p}, h, targets_BxT)
            return logp.mean()
        return jax.value_and_grad(loss, argnums=(0, 1))(params, hidden_BxTxD)

    def decode(params, hidden_BxD, keys_B):
        logits = spec.logits({**full, **params}, hidden_BxD)
        ones = jnp.ones(hidden_BxD.shape[0], jnp.float32)
        zeros = jnp.zeros(hidden_BxD.shape[0], jnp.int32)
        return sample_rows(logits, keys_B, ones, zeros, ones, True, False)

    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 256))
    return {"train head (8 x 512 tokens, fwd + bwd)":
            (train, (head, sds((8, 512, width), jnp.bfloat16), sds((8, 512), jnp.int32))),
            "decode head + sampling (256 rows)":
            (decode, (head, sds((256, width), jnp.bfloat16), keys))}


def account(args: argparse.Namespace) -> list[dict]:
    import jax

    jax.config.update("jax_platforms", "cpu")  # as `gpurl plan plan.target`: no CUDA backend

    from gpurl.plan.account import Account
    from gpurl.distributed.mesh import job_devices
    from gpurl.plan.targets import compile_only, gpu

    target, rows = gpu("h100"), []
    print("\nThe head's programs on a compile-only H100 (XLA's GPU compiler, bf16), the "
          "compiler's account\n")
    print("| model (V x D) | program | head | GB of HBM | TFLOP | roofline ms |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    with compile_only(target, 1):
        device = job_devices()[0]
        for model in args.models:
            for name, (fn, shapes) in _programs(*SIZES[model]).items():
                for head in HEADS:
                    with bf16_head(head == "bf16 head"):
                        placed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(
                            s.shape, s.dtype, sharding=jax.sharding.SingleDeviceSharding(device)),
                            shapes)
                        # a fresh function: jit would reuse the other head's trace
                        text = jax.jit(lambda *a, fn=fn: fn(*a)).lower(*placed).compile().as_text()
                    cost = Account(text).program()
                    ms = 1e3 * max(cost.bytes / target.bandwidth, cost.flops / target.bf16_flops)
                    rows.append(dict(model=model, program=name, head=head, gb=cost.bytes / 1e9,
                                     tflop=cost.flops / 1e12, ms=ms))
                    v, d = SIZES[model]
                    print(f"| {model} ({v:,} x {d}) | {name} | {head} | {cost.bytes / 1e9:.3f} "
                          f"| {cost.flops / 1e12:.3f} | {ms:.3f} |")
    return rows


def smoke(args: argparse.Namespace) -> None:
    """Both parts at tiny sizes; the account only where XLA's GPU compiler is installed."""
    from gpurl.plan.targets import compiler_installed

    args.steps, args.runs, args.models = 3, 1, ["gemma3_270m"]
    args.extra = ["model=tiny", "model.tokenizer=bytes", "data=arithmetic", *args.extra]
    cpu(args)
    if compiler_installed():
        account(args)
    else:
        print("account: skipped: XLA's GPU compiler (the gpu-plan extra) is not installed")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "child":  # `gpurl` with the head chosen: child HEAD -- ARGS
        head, rest = argv[1], argv[argv.index("--") + 1:]
        sys.argv = ["gpurl", *rest]
        from gpurl.cli import run

        with bf16_head(head == "bf16 head"):
            run()
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", nargs="?", choices=("cpu", "account"), help="--smoke: both")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--models", nargs="+", default=list(SIZES))
    p.add_argument("--json", type=Path, help="write the table here too")
    p.add_argument("extra", nargs="*", help="more gpurl overrides for the cpu part")
    p.add_argument("--smoke", action="store_true", help="both parts, in seconds: the cpu part on "
                   "the tiny random model (1 run x 3 steps), the account on gemma3_270m's head")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke(args)
    if args.part is None:
        p.error("name the part: cpu or account (or --smoke).")
    out = cpu(args) if args.part == "cpu" else account(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

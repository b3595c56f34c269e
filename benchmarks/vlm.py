"""Vision-language models on CPU: rollout and train-step throughput with and without images
(issue 67), on a small random Gemma 3 layout with a SigLIP tower.

Rollout (`gpurl.rollout.engine.Engine`, greedy, every request generating its
`--new-tokens`): P prompts x G completions of
- `text`: prompts of the same length with text tokens where the image tokens would be;
- `images, shared`: one image per prompt, its G requests carrying the same image digest,
  so the engine prefills the prompt (and runs the tower) once for the group;
- `images, per row`: the same images, each request with a digest of its own, so every
  row prefills its prompt and runs the tower: what a rollout that does not share image
  features across a group costs.

Train step: a jitted forward and backward of the language model (the tower frozen: no
gradient flows into it, as `model.vision.trainable=false`) on B rows, with and without
their images (the tower runs on the images inside the step).

The table reports medians over `--repeats` timed calls after one warm-up (compiles), the
cases interleaved. Not measured here yet: the compile-only H100 account of a 7B VLM GRPO
step (the tower's share of flops and bytes); docs/vision.md lists it as open.

    python benchmarks/vlm.py                 # the small VLM: ~2 min on 2 cores
    python benchmarks/vlm.py --smoke         # the tiny one: the script runs
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gpurl.config import MeshConfig, ModelConfig, RolloutConfig, VisionConfig
from gpurl.distributed.mesh import rollout_mesh
from gpurl.models import model_spec
from gpurl.rollout.engine import Engine
from gpurl.rollout.requests import Request

IMAGE, BOI, EOI, TEXT = 509, 510, 511, 7  # the image tokens at the top of a 512-id vocabulary


def model(smoke: bool) -> ModelConfig:
    """A small Gemma 3 layout with a tower (the tiny one under --smoke)."""
    if smoke:
        vision = VisionConfig(layers=1, width=32, heads=2, mlp_dim=64, image_size=32, patch=4,
                              tokens=16, image_token_id=IMAGE, boi_token_id=BOI,
                              eoi_token_id=EOI)
        return ModelConfig(family="gemma3", vocab_size=512, d_model=32, num_layers=2,
                           num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
                           dtype="float32", post_norms=True, qk_norm=True, vision=vision)
    vision = VisionConfig(layers=4, width=256, heads=4, mlp_dim=1024, image_size=224, patch=14,
                          tokens=64, image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)
    return ModelConfig(family="gemma3", vocab_size=512, d_model=256, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=64, mlp_dim=1024, dtype="float32",
                       post_norms=True, qk_norm=True, vision=vision)


def prompts(cfg: ModelConfig, count: int, text: int, images: bool) -> list[list[int]]:
    """`count` prompts: BOS, `text` tokens, an image (or as many text tokens), a question."""
    v = cfg.vision
    block = [BOI] + [IMAGE] * v.tokens + [EOI] if images else [TEXT] * (v.tokens + 2)
    rng = np.random.default_rng(0)
    return [[2] + rng.integers(3, 256, text).tolist() + block + [11, 12] for _ in range(count)]


def pixels(cfg: ModelConfig, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    size = cfg.vision.image_size
    return [rng.uniform(-1, 1, (3, size, size)).astype(np.float32) for _ in range(count)]


def rollout_case(engine: Engine, params, cfg: ModelConfig, case: str, p: int, g: int,
                 text: int, new: int) -> tuple[list[Request], int]:
    """The requests of a case, and the useful tokens they generate."""
    with_images = case != "text"
    rows = prompts(cfg, p, text, with_images)
    images = pixels(cfg, p) if with_images else [None] * p
    out = []
    for i, (prompt, image) in enumerate(zip(rows, images)):
        for j in range(g):
            extra = {}
            if image is not None:  # shared: the prompt's digest; per row: the row's own
                key = f"p{i}" if case == "images, shared" else f"p{i}r{j}"
                extra = {"images": (image,), "images_key": key}
            out.append(Request(tuple(prompt), new, 0.0, seed=i * g + j, **extra))
    return out, p * g * new


def train_fn(spec, cfg: ModelConfig, with_images: bool):
    """A jitted forward and backward of the language model over B rows (loss: mean
    next-token NLL), the tower frozen."""
    def loss(lm, tower, tokens, pixels):
        params = {**lm, "vision": tower}
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits = spec.apply(params, tokens, positions, jnp.ones_like(tokens),
                            pixels if with_images else None)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    return jax.jit(jax.value_and_grad(loss))


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: compiles
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.prompts, args.group, args.new_tokens = 1, 2, 2, 4
    cfg = model(args.smoke)
    spec = model_spec(cfg)
    params = jax.jit(lambda: spec.init(0))()
    mesh = rollout_mesh(MeshConfig(rollout_tp=1), devices=jax.devices()[:1])
    rollout = RolloutConfig(max_new_tokens=args.new_tokens, temperature=0.0, slots=64)
    engine = Engine(spec, rollout, mesh, MeshConfig().sample_rules, stop_ids=(), pad_id=0)
    text = 32
    cases = ("text", "images, shared", "images, per row")
    built = {c: rollout_case(engine, params, cfg, c, args.prompts, args.group, text,
                             args.new_tokens) for c in cases}
    seconds: dict[str, list[float]] = {c: [] for c in cases}
    prefills: dict[str, float] = {}
    for c in cases:  # warm-up: compiles each case's shapes
        engine.generate(params, built[c][0])
    for _ in range(args.repeats):
        for c in cases:  # interleaved
            t0 = time.perf_counter()
            engine.generate(params, built[c][0])
            seconds[c].append(time.perf_counter() - t0)
            prefills[c] = engine.stats["prefill_tokens"]
    print(f"\nrollout: {args.prompts} prompts x G={args.group}, {text + cfg.vision.tokens + 5}-token "
          f"prompts ({cfg.vision.tokens} image tokens), {args.new_tokens} new tokens each, "
          f"median of {args.repeats}\n")
    print("| case | s | tokens/s | vs text | prefill tokens |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = statistics.median(seconds["text"])
    for c in cases:
        s = statistics.median(seconds[c])
        print(f"| {c} | {s:.3f} | {built[c][1] / s:.1f} | {base / s:.2f}x | {prefills[c]:.0f} |")

    b = args.prompts * args.group
    lm = {k: v for k, v in params.items() if k != "vision"}
    tokens_with = jnp.asarray(np.asarray(prompts(cfg, b, text, True)), jnp.int32)
    tokens_without = jnp.asarray(np.asarray(prompts(cfg, b, text, False)), jnp.int32)
    images = jnp.asarray(np.stack(pixels(cfg, b))[:, None])
    steps = {"text": (train_fn(spec, cfg, False), tokens_without),
             "images": (train_fn(spec, cfg, True), tokens_with)}
    train_s = {name: timed(lambda f=f, t=t: jax.block_until_ready(
        f(lm, params["vision"], t, images)), args.repeats) for name, (f, t) in steps.items()}
    print(f"\ntrain step (forward + backward of the language model, tower frozen): {b} rows of "
          f"{tokens_with.shape[1]} tokens, median of {args.repeats}\n")
    print("| case | s | tokens/s | vs text |")
    print("| --- | ---: | ---: | ---: |")
    for name, s in train_s.items():
        print(f"| {name} | {s:.3f} | {tokens_with.size / s:.0f} | {train_s['text'] / s:.2f}x |")


if __name__ == "__main__":
    main()

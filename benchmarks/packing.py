"""Packed against padded RL training: the train phase of a GRPO step on a long-tail mix.

The mix (issue 32; the rollout benchmark's): P prompts of 32 tokens x G = 8 completions,
of which 75% have 32 tokens, 19% 128 and 6% 512 (for P = 8: 48, 12 and 4). The train
phase is what a step does after its rollout: the prepare step (the frozen reference's
log-probs, advantages) and the train step (the policy's forward and backward over every
micro-batch, one optimizer step), on the main job's model (Gemma 3 270M, real weights)
with `algo.beta` > 0 so the reference pass runs. Both layouts take the same batch, the
same train state and the same token budget (`train.micro_batch_tokens`: what one padded
micro-batch holds), and run interleaved: padded, packed, padded, packed...

Reported per layout: the median seconds of the train phase, the slots the model computes
(prompt and completion slots of every pass) over the useful tokens (each prompt once per
group plus its completions), and the compiled programs' memory per device (arguments +
temporaries from `memory_analysis()`, the larger of prepare and train step).

    python benchmarks/packing.py                           # the mix above (CPU: ~30 min)
    python benchmarks/packing.py --prompts 2 --repeats 1   # a quarter of it
    python benchmarks/packing.py --smoke                   # tiny random model, seconds
    PYTHONPATH=.venv/gpu-compiler python benchmarks/packing.py --gpu h100

`--gpu h100` runs nothing: it compiles both layouts' prepare and train steps for a
compile-only H100 with XLA's GPU compiler (the `gpu-plan` extra, as `gpurl plan
plan.target=h100` does; bf16, remat full), one micro-batch each, and prints XLA's cost
analysis of each (flops, bytes accessed). XLA counts a loop's body once: the layer scan
(one layer of each pass) and the chunked vocabulary head (one chunk) are undercounted in
both layouts, the head most where it has most chunks (the padded layout), so the ratio
understates what packing saves; the embedding, the norms and everything outside loops
count in full.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from gpurl.cli.compose import validate
from gpurl.data import packing
from gpurl.data.rollouts import RolloutBatch
from gpurl.train.loop import build

MIX = ((32, 0.75), (128, 0.1875), (512, 0.0625))  # completion tokens, share of completions
PROMPT, GROUP = 32, 8


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch (x G = 8)")
    p.add_argument("--repeats", type=int, default=2, help="timed train phases per layout")
    p.add_argument("--micro", type=int, default=1, help="train.micro_batch_size (prompts)")
    p.add_argument("--smoke", action="store_true", help="tiny random model, short mix")
    p.add_argument("--gpu", default="", help="compile for this GPU kind (h100, ...) instead")
    p.add_argument("--json", default="", help="also write the table here")
    p.add_argument("overrides", nargs="*", help="more `gpurl train` overrides (after --)")
    args = p.parse_args(argv)
    if args.smoke:  # micro-batches of 4 prompts: whole on 4 host devices too
        args.repeats, args.micro = 1, 4
    return args


def lengths(prompts: int, longest: int, seed: int = 0) -> np.ndarray:
    """P x G completion lengths of the mix, shuffled over the groups."""
    rows = prompts * GROUP
    counts = [round(share * rows) for _, share in MIX]
    counts[0] += rows - sum(counts)
    mix = np.repeat([min(n, longest) for n, _ in MIX], counts)
    return np.random.default_rng(seed).permutation(mix).reshape(prompts, GROUP)


def overrides(args: argparse.Namespace, packed: bool) -> list[str]:
    longest = 64 if args.smoke else MIX[-1][0]
    model = (["model=tiny", "model.tokenizer=bytes", "data=arithmetic"] if args.smoke else [])
    return [*model, "algo=grpo", "algo.beta=0.04", f"algo.num_generations={GROUP}",
            f"train.batch_size={args.prompts}", f"train.micro_batch_size={args.micro}",
            f"rollout.max_new_tokens={longest}", "data.num_eval=0", "train.eval_every=0",
            f"train.packed={str(packed).lower()}", "plan.check=false", *args.overrides]


def collected(stepper: Any, clen_PxG: np.ndarray) -> tuple[RolloutBatch, jax.Array]:
    """The grouped batch the collector would hand over: prompts of PROMPT tokens, the
    mix's completion lengths, random tokens and sampler log-probs."""
    rng = np.random.default_rng(1)
    p, g = clen_PxG.shape
    w, n = stepper.rounds.prompt_width, stepper.rounds.width
    plen = np.full(p, min(PROMPT, w))
    real = np.arange(n) < clen_PxG[..., None]
    vocab = stepper.setup.spec.policy.cfg.vocab_size
    batch = {"prompt_tokens": np.where(np.arange(w) < plen[:, None], rng.integers(3, vocab, (p, w)), 0),
             "prompt_lengths": plen, "completions": np.where(real, rng.integers(3, vocab, (p, g, n)), 0),
             "completion_lengths": clen_PxG, "comp_mask": real.astype(np.float32),
             "sampler_logprobs": np.where(real, -1.0, 0.0).astype(np.float32)}
    sh = stepper.setup.place.batch
    out = {k: jax.device_put(np.asarray(v, np.float32 if v.dtype == np.float32 else np.int32), sh)
           for k, v in batch.items()}
    return RolloutBatch(**out), jax.device_put(rng.uniform(0, 1, p * g).astype(np.float32), sh)


def train_phase(setup: Any, stepper: Any, state: Any, batch: RolloutBatch, packed: dict | None,
                rewards: jax.Array, static: tuple) -> tuple[Any, float]:
    """(the updated state, seconds of prepare + train step: dispatch to the updated
    parameters' arrival) of an RL stepper on a collected batch (`packed`: its packed
    layout's arrays, or None)."""
    s = stepper
    t0 = time.perf_counter()
    prepared, _, _ = s._prepare(state.params, *s.frozen.values(), batch, packed, rewards,
                                s.carry)
    state, metrics = setup.step_fn(state, prepared, None, *static)
    jax.block_until_ready((state.params, metrics))
    return state, time.perf_counter() - t0


class Layout:
    """One layout's stepper, state and batch, and its train phase."""

    def __init__(self, args: argparse.Namespace, packed: bool, clen_PxG: np.ndarray):
        self.name = "packed" if packed else "padded"
        cfg = validate(overrides(args, packed))
        self.cfg, self.setup, self.stepper = build(cfg)
        self.state = self.setup.init()
        self.batch, self.rewards = collected(self.stepper, clen_PxG)
        self.static: tuple = ()
        self.packed = None
        p, g, n = self.batch.completions.shape
        w = self.batch.prompt_tokens.shape[1]
        self.slots = p * w + p * g * n  # the padded forward: prompts once, then P x G x N
        self.memory = 0.0
        if packed:
            plan = self.stepper._pack(self.batch)
            self.packed = packing.put(plan, self.stepper.setup.place.batch)
            self.static = (plan.num_micro,)
            self.slots = int(np.prod(plan.shape))
            self.shape = f"{plan.shape[0]} rows x {plan.shape[1]}, {plan.num_micro} micro"
        else:
            self.shape = f"{p} x {g} x {n} + prompts {p} x {w}, {cfg.train.num_micro_batches} micro"

    def phase(self) -> float:
        """Seconds of prepare + train step (dispatch to the updated parameters' arrival)."""
        self.state, seconds = train_phase(self.setup, self.stepper, self.state, self.batch,
                                          self.packed, self.rewards, self.static)
        return seconds

    def measure_memory(self) -> None:
        """Arguments + temporaries per device of the prepare step and of the train step."""
        s = self.stepper
        args = (self.state.params, *s.frozen.values(), self.batch, self.packed, self.rewards,
                s.carry)
        prepared = s._prepare.lower(*args).compile()
        batch = jax.eval_shape(s._prepare, *args)[0]
        train = self.setup.step_fn.jitted.lower(self.state, batch, None, *self.static).compile()
        self.memory = max(_bytes(prepared), _bytes(train))


def _bytes(compiled: Any) -> float:
    m = compiled.memory_analysis()
    return float(m.argument_size_in_bytes + m.temp_size_in_bytes)


def _gpu_cost(compiled: Any) -> dict[str, float]:
    """XLA's HLO cost analysis of a compile-only GPU program (its `cost_analysis()` is
    empty without a GPU; the analysis itself runs on the optimized module here)."""
    from jax._src.lib import xla_client

    module = compiled.runtime_executable().hlo_modules()[0]
    cpu = jax.devices("cpu")[0].client
    return dict(xla_client._xla.hlo_module_cost_analysis(cpu, module))


def gpu_costs(args: argparse.Namespace, clen_PxG: np.ndarray) -> None:
    """XLA's GPU cost analysis of both layouts' prepare and train steps (see above)."""
    import dataclasses

    from gpurl.commands.plan import compiled_for, planned_config, start_backend
    from gpurl.config import PlanConfig
    from gpurl.distributed.mesh import abstract, sharded

    start_backend(PlanConfig(target=args.gpu))
    args.micro = args.prompts  # one micro-batch each: XLA counts the micro-batch loop's body once
    rows = []
    for packed in (False, True):
        cfg = validate(overrides(args, packed))
        cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, target=args.gpu))
        with compiled_for(cfg):
            cfg, setup, stepper = build(planned_config(cfg))
            place, static = setup.place, ()
            collected, packed_spec = stepper._collected_spec()
            p, g, n = collected.completions.shape
            shape = f"{p} x {g} x {n} + prompts {p} x {collected.prompt_tokens.shape[1]}"
            if packed:
                plen = np.full(len(clen_PxG), PROMPT)
                plan = packing.plan(plen, clen_PxG, stepper.rounds.prompt_width, stepper.rounds.width,
                                    stepper.budget, stepper.shards,
                                    packing.attention_cost(setup.spec.policy.cfg.d_model))
                sds = jax.ShapeDtypeStruct
                packed_spec = {k: sds(v.shape, np.int32) for k, v in packing.plan_arrays(plan).items()}
                static = (plan.num_micro,) if plan.num_micro > 1 else ()
                shape = f"{plan.shape[0]} rows x {plan.shape[1]}, {plan.num_micro} micro"
            prep_args = stepper._prepare_args(*sharded((collected, packed_spec), place.batch))
            prepared = stepper._prepare.lower(*prep_args).compile()
            batch = jax.eval_shape(stepper._prepare, *prep_args)[0]
            train = setup.step_fn.jitted.lower(abstract(place.abstract_state, place.state),
                                               sharded(batch, place.batch), None, *static).compile()
            costs = [_gpu_cost(c) for c in (prepared, train)]
            rows.append((shape, *(c.get("flops", 0.0) for c in costs),
                         *(c.get("bytes accessed", 0.0) for c in costs)))
    print(f"\nXLA GPU cost analysis ({args.gpu}, compile-only), {args.prompts} prompts x G={GROUP}")
    print("| layout | shape | prepare GFLOP | train step GFLOP | prepare GB | train step GB |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, (shape, pf, tf, pb, tb) in zip(("padded", "packed"), rows):
        print(f"| {name} | {shape} | {pf / 1e9:.1f} | {tf / 1e9:.1f} | {pb / 1e9:.2f} | {tb / 1e9:.2f} |")
    (_, pf0, tf0, *_), (_, pf1, tf1, *_) = rows
    print(f"padded / packed flops: prepare {pf0 / max(pf1, 1):.2f}x, train step {tf0 / max(tf1, 1):.2f}x")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.gpu:
        return gpu_costs(args, lengths(args.prompts, 64 if args.smoke else MIX[-1][0]))
    longest = 64 if args.smoke else MIX[-1][0]
    clen = lengths(args.prompts, longest)
    useful = int(clen.sum() + args.prompts * PROMPT)
    layouts = [Layout(args, packed, clen) for packed in (False, True)]
    for lay in layouts:
        lay.measure_memory()
        first = lay.phase()  # compiles
        print(f"[packing] {lay.name}: {lay.shape}; first phase {first:.1f} s (with compile)",
              flush=True)
    times: dict[str, list[float]] = {lay.name: [] for lay in layouts}
    for _ in range(args.repeats):
        for lay in layouts:
            times[lay.name].append(lay.phase())
            print(f"[packing] {lay.name}: {times[lay.name][-1]:.1f} s", flush=True)
    rows = []
    for lay in layouts:
        rows.append({"layout": lay.name, "shape": lay.shape,
                     "train_phase_s": round(statistics.median(times[lay.name]), 2),
                     "slots_per_useful_token": round(lay.slots / useful, 2),
                     "memory_gib": round(lay.memory / 2**30, 3)})
    padded, packed = rows
    print(f"\nGRPO train phase, {args.prompts} prompts x G={GROUP}, completion lengths "
          f"{dict(zip(*np.unique(clen, return_counts=True)))}, {useful} useful tokens, "
          f"{jax.devices()[0].platform}")
    print("| layout | shape | train phase s | slots / useful token | memory GiB |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['layout']} | {r['shape']} | {r['train_phase_s']} | "
              f"{r['slots_per_useful_token']} | {r['memory_gib']} |")
    print(f"packed / padded: {padded['train_phase_s'] / packed['train_phase_s']:.2f}x faster, "
          f"memory {packed['memory_gib'] / max(padded['memory_gib'], 1e-9):.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "times": times,
                                               "useful_tokens": useful}, indent=1))


if __name__ == "__main__":
    main()

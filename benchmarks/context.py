"""The context axis on CPU host devices: a GRPO train phase (prepare + train step) whose
packed rows are split over 1, 2 and 4 devices (`mesh.context`), interleaved.

A random model (`--width`, 4 layers) on 4 forced host devices: P prompts of 32 tokens x
G completions of `--tokens` tokens, one row per micro-batch (`train.micro_batch_tokens=1`),
so a device holds Z / C slots of a row. Width 1 splits rows over the data axis instead
(`mesh.data=4`: the same 4 devices, one row each); widths 2 and 4 take `mesh.data=4/C`.
Reported per width: the median seconds of the train phase, and the train step's memory
per device (XLA's `memory_analysis()`: arguments + temporaries). CPU figures say what the
split costs in collectives and duplicated work on one machine, not what a GPU gains:
`gpurl plan plan.target=h100 mesh.context=...` gives the GPU's account.

    python benchmarks/context.py                  # 4 x 4 completions of 4,096 tokens
    python benchmarks/context.py --tokens 1024 --repeats 1   # a quick look
    python benchmarks/context.py --smoke                     # tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Sequence

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from gpurl.cli.compose import validate  # noqa: E402
from gpurl.data import packing  # noqa: E402
from gpurl.train.loop import build  # noqa: E402
from packing import collected, train_phase  # noqa: E402  (benchmarks/packing.py)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="completion tokens")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--width", type=int, default=256, help="model.d_model")
    p.add_argument("--repeats", type=int, default=3, help="timed train phases per width")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, in seconds: checks the script end to end")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.prompts, args.group, args.width, args.repeats = 32, 4, 2, 32, 1
    return args


class Width:
    def __init__(self, args: argparse.Namespace, context: int):
        self.context = context
        cfg = validate([
            "model=tiny", "model.tokenizer=bytes", "data=arithmetic", "data.num_eval=0",
            f"model.d_model={args.width}", f"model.mlp_dim={4 * args.width}",
            "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=4",
            f"model.head_dim={args.width // 8}", "model.dtype=float32",
            "algo=grpo", "algo.beta=0.04", f"algo.num_generations={args.group}",
            f"train.batch_size={args.prompts}", f"train.micro_batch_size={args.prompts}",
            "train.micro_batch_tokens=1", f"rollout.max_new_tokens={args.tokens}",
            f"mesh.data={4 // context}", f"mesh.context={context}", "plan.check=false"])
        self.cfg, self.setup, self.stepper = build(cfg)
        self.state = self.setup.init()
        self.batch, self.rewards = collected(self.stepper, _lengths(self.stepper, args.tokens))
        plan = self.stepper._pack(self.batch)
        self.packed = packing.put(plan, self.setup.place.batch)
        self.static = (plan.num_micro,) if plan.num_micro > 1 else ()
        self.shape = f"{plan.shape[0]} rows x {plan.shape[1]}, {plan.num_micro} micro"

    def phase(self) -> float:
        self.state, seconds = train_phase(self.setup, self.stepper, self.state, self.batch,
                                          self.packed, self.rewards, self.static)
        return seconds

    def memory(self) -> float:
        s = self.stepper
        args = (self.state.params, *s.frozen.values(), self.batch, self.packed, self.rewards,
                s.carry)
        batch = jax.eval_shape(s._prepare, *args)[0]
        m = self.setup.step_fn.jitted.lower(self.state, batch, None, *self.static).compile(
            ).memory_analysis()
        return float(m.argument_size_in_bytes + m.temp_size_in_bytes)


def _lengths(stepper: Any, tokens: int) -> np.ndarray:
    """P x G completion lengths: `tokens` each, the last of each group half as long."""
    clen = np.full((stepper.train.batch_size, stepper.algo.num_generations), tokens)
    clen[:, -1] //= 2
    return clen


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    widths = [Width(args, c) for c in (1, 2, 4)]
    for w in widths:
        w.phase()  # compile
    times: dict[int, list[float]] = {w.context: [] for w in widths}
    for _ in range(args.repeats):
        for w in widths:
            times[w.context].append(w.phase())
    base = statistics.median(times[1])
    print(f"\nGRPO train phase, {args.prompts} x {args.group} completions of {args.tokens} "
          f"tokens, d_model {args.width}, 4 CPU host devices, median of {args.repeats}")
    print("| mesh.context | rows | train phase s | vs width 1 | train step memory per device, MB |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for w in widths:
        t = statistics.median(times[w.context])
        print(f"| {w.context} | {w.shape} | {t:.2f} | {t / base:.2f}x | {w.memory() / 1e6:.1f} |")


if __name__ == "__main__":
    main()

"""Synchronous, one-step-ahead and continuous rollouts: step throughput and idle time.

The main job (GRPO on the real Gemma 3 270M, addition) with split placement over host
devices (one rollout device, one trainer device), answers allowed up to `--tokens` tokens
so their lengths have a long tail (most stop at the newline after a few tokens, a few run
to the limit). Each mode is built, warmed up (one step: its programs compile), then timed
over `--steps` steps, the three modes in one run:

- sync: `rollout.mode=sync` (each step samples, then trains);
- one_step_off: `rollout.mode=one_ahead` (step s+1's first round sampled while step s trains);
- continuous: `rollout.mode=continuous` (the engine never stops; new weights enter
  between decode chunks; `rollout.swap_chunks=0`: as soon as they are computed).

Reported per mode, over the whole timed window (from the first timed step's start until
the last one's parameters are computed; a continuous step returns once its batch is
dispatched, so per-step intervals say little): seconds per step and samples per second;
the seconds JAX spent tracing and compiling in the window (a new shape met during the
timed steps; the same shapes recur in every mode, but which steps meet them is chance)
and the step time without them; the fraction of the window each side was busy: the
rollout engine's scheduling iterations (prefills and decode chunks, host work included)
and the trainer's programs (from a train step's dispatch, or the end of the one before
it, to its parameters being computed); the lengths of the completions trained. On a CPU
both sides share the same cores, so an overlap here cannot be a speed-up by itself; the
idle fractions say how much of each side's time the mode lets the other use, which is
what turns into throughput on GPUs.

    python benchmarks/async.py                        # the real model (CPU: ~8 min)
    python benchmarks/async.py --smoke                # tiny random model, seconds
    python benchmarks/async.py --plot timeline.png    # the time lines of the three modes
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from gpurl.cli.compose import validate  # noqa: E402
from gpurl.rollout.engine import Stream  # noqa: E402
from gpurl.train.loop import build  # noqa: E402

ITERATE = Stream.iterate  # the untimed scheduling iteration (`Timeline.watch_engine`)

MODES = {"sync": [], "one_step_off": ["rollout.mode=one_ahead"],
         "continuous": ["rollout.mode=continuous", "rollout.swap_chunks=0"]}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles)")
    p.add_argument("--tokens", type=int, default=48, help="rollout.max_new_tokens")
    p.add_argument("--smoke", action="store_true", help="tiny random model")
    p.add_argument("--plot", default="", help="write the time lines here (PNG)")
    p.add_argument("--json", default="", help="also write the table here")
    p.add_argument("overrides", nargs="*", help="more `gpurl train` overrides (after --)")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.tokens = 2, 1, 16
    return args


def overrides(args: argparse.Namespace, mode: str) -> list[str]:
    model = ["model=tiny", "model.tokenizer=bytes", "data=arithmetic"] if args.smoke else []
    # smoke: half of the test's 4 host devices each side (the full run: 1 and 1 of 2)
    rollout_devices = max(1, jax.device_count() // 2) if args.smoke else 1
    return [*model, "mesh.placement=split", f"mesh.rollout_devices={rollout_devices}",
            "train.eval_every=0", "data.num_eval=0", "train.checkpoint_every=0",
            f"rollout.max_new_tokens={args.tokens}",
            f"train.steps={args.warmup + args.steps}", "plan.check=false", "logger.progress=false",
            *MODES[mode], *args.overrides]


COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class Timeline:
    """(start, end) intervals of each side's activity, and of JAX's tracing and compiling
    (a new shape met during the timed steps), host clock."""

    def __init__(self) -> None:
        self.rollout: list[tuple[float, float]] = []
        self.train: list[tuple[float, float]] = []
        self.compile: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._compiled)

    def stop(self) -> None:
        """Ends the compile lane (the listener stays registered: JAX has no removal)."""
        self.compile_open = False

    compile_open = True

    def _compiled(self, event: str, seconds: float, **_: Any) -> None:
        if event in COMPILE_EVENTS and self.compile_open:
            now = time.perf_counter()
            self.compile.append((now - seconds, now))

    def watch_engine(self) -> None:
        """Times every scheduling iteration of every generation (`Stream.iterate`)."""
        def timed(stream: Stream, *a: Any) -> Any:
            t0 = time.perf_counter()
            out = ITERATE(stream, *a)
            self.rollout.append((t0, time.perf_counter()))
            return out
        Stream.iterate = timed

    def watch_train(self, params: Any, dispatched: float) -> threading.Thread:
        """The train step that was dispatched at `dispatched` ends when `params` are."""
        def wait() -> None:
            jax.block_until_ready(params)
            done = time.perf_counter()
            with self._lock:
                start = max(dispatched, self.train[-1][1] if self.train else dispatched)
                self.train.append((start, done))
        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        return thread

    def busy(self, side: str, lo: float, hi: float) -> float:
        spans = sorted(getattr(self, side))
        total, reach = 0.0, lo
        for a, b in spans:
            a, b = max(a, reach), min(b, hi)
            if b > a:
                total += b - a
                reach = b
        return total / (hi - lo)


def run(mode: str, args: argparse.Namespace) -> tuple[dict, Timeline, float]:
    cfg, setup, stepper = build(validate(overrides(args, mode)))
    line = Timeline()
    line.watch_engine()
    state = setup.init()
    for step in range(args.warmup):  # compiles
        state, _ = stepper.step(state, step)
    jax.block_until_ready(state.params)
    line.rollout.clear()
    watchers, lengths = [], []
    collect = stepper.collector.batch

    def batch(rounds: list, *a: Any) -> Any:
        lengths.extend(np.concatenate([r.local["lengths"] for r in rounds]).tolist())
        return collect(rounds, *a)
    stepper.collector.batch = batch
    t_start = time.perf_counter()
    for step in range(args.warmup, args.warmup + args.steps):
        state, _ = stepper.step(state, step)
        watchers.append(line.watch_train(state.params, time.perf_counter()))
    for w in watchers:
        w.join()
    t_end = time.perf_counter()
    line.stop()
    # the whole timed window: a continuous step returns as soon as its batch is
    # dispatched, so per-step intervals say little; steps x rows over the window does
    wall = t_end - t_start
    compiling = line.busy("compile", t_start, t_end) * wall
    rows = cfg.train.batch_size * cfg.algo.num_generations
    lens = np.asarray(lengths)
    figures = {"mode": mode, "step_s": round(wall / args.steps, 3),
               "samples_per_s": round(rows * args.steps / wall, 3),
               "compile_s": round(compiling, 2),
               "step_s_less_compiles": round((wall - compiling) / args.steps, 3),
               "rollout_busy": round(line.busy("rollout", t_start, t_end), 3),
               "train_busy": round(line.busy("train", t_start, t_end), 3),
               "length_p50": float(np.median(lens)), "length_p95": float(np.percentile(lens, 95)),
               "length_max": int(lens.max())}
    return figures, line, t_start


def plot(lines: dict[str, tuple[Timeline, float]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(lines), 1, figsize=(10, 1.9 * len(lines)), sharex=True)
    for ax, (mode, (line, t0)) in zip(np.atleast_1d(axes), lines.items()):
        lanes = (("compile", "tab:gray"), ("train", "tab:orange"), ("rollout", "tab:blue"))
        for lane, (side, color) in enumerate(lanes):
            spans = [(a - t0, b - a) for a, b in getattr(line, side) if b > t0]
            ax.broken_barh(spans, (lane * 10, 8), color=color)
        ax.set_yticks([4, 14, 24], [side for side, _ in lanes])
        ax.set_title(mode, fontsize=9, loc="left")
    np.atleast_1d(axes)[-1].set_xlabel("seconds from the first timed step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    table, lines = [], {}
    for mode in MODES:
        figures, line, t0 = run(mode, args)
        table.append(figures)
        lines[mode] = (line, t0)
        print(json.dumps(figures), flush=True)
    keys = list(table[0])
    print("| " + " | ".join(keys) + " |\n| " + " | ".join("---" for _ in keys) + " |")
    for row in table:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
    if args.plot:
        plot(lines, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()

"""Generation throughput: gpurl's `StaticSampler` against transformers' `generate`, one process.

Both run the real Gemma 3 270M (the GGUF from the PyPI package, dequantized to float32) on
the same prompts: every row has exactly `--prompt-tokens` tokens (no padding on either
side) and every row generates exactly `--new-tokens` tokens (no stop ids for gpurl, no EOS
for transformers). Greedy and sampled (temperature 1, no top-k / top-p truncation).

Timings are wall-clock from the host call until the tokens are on the host. Each
(implementation, batch, mode) is warmed up first, apart from the timings: gpurl with a full
call, which traces and compiles (the compile time reported is what JAX itself records for
tracing, lowering and XLA compilation), transformers with a 2-token call (nothing to
compile). The repetitions are interleaved (gpurl and transformers alternate inside each
one), so a machine shared with other work slows both alike and the ratio stays meaningful;
the table reports medians, and the same from each cell's fastest call ("best").

    python benchmarks/generate.py --batches 1,8,32 --new-tokens 64 --repeats 3 --json out.json
    python benchmarks/generate.py --smoke   # the tiny random model (transformers: its HF export)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

MODES = {"greedy": 0.0, "sampled": 1.0}  # mode -> temperature
Runner = Callable[[list[list[int]], float, int, int], None]  # (prompts, temperature, seed, new)
# Original prose (not from a dataset); rows take different windows of its tokens.
TEXT = (
    "At the edge of the old harbour there is a workshop where boats have been repaired for "
    "three generations. In winter, when the fishing fleet stays in port, the floor is "
    "covered with shavings of oak and larch, and the smell of tar drifts out into the "
    "narrow street. The youngest carpenter keeps a notebook of every hull that comes "
    "through the door: its length, the wood of its keel, the name painted on its bow and "
    "the storms its owner remembers. Some of the boats are older than the workshop itself. "
    "One of them, a small open boat with a patched red sail, has come back every spring for "
    "forty years, and each time a different plank needs replacing, so that by now hardly a "
    "piece of the original remains. The owner insists it is the same boat. The carpenters "
    "argue about it over lunch, but they always agree to fix it. Down the quay the ferry "
    "leaves at seven and returns at dusk, and the gulls follow it both ways. Children fish "
    "from the steps with lines of string and bent pins, and sometimes they catch something."
)


class CompileTimer:
    """Seconds JAX spends tracing, lowering and compiling, from its monitoring events."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self) -> None:
        import jax.monitoring

        self.total_s = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event: str, duration_s: float, **_: Any) -> None:
        if event in self.EVENTS:
            self.total_s += duration_s


@dataclass
class Cell:
    """Timings of one (implementation, mode, batch): seconds per call."""

    impl: str
    mode: str
    batch: int
    warmup_s: float = 0.0
    compile_s: float = 0.0  # gpurl: JAX's trace + lower + compile time during the warm-up
    times_s: list[float] = field(default_factory=list)

    def median_s(self) -> float:
        return statistics.median(self.times_s)

    def tokens_per_s(self, new_tokens: int, best: bool = False) -> float:
        """From the median call, or from the fastest one (`best`: the least disturbed by
        other work on a shared machine)."""
        return self.batch * new_tokens / (min(self.times_s) if best else self.median_s())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per row")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (bos included)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per cell (median)")
    p.add_argument("--modes", default="greedy,sampled", help=f"subset of {','.join(MODES)}")
    p.add_argument("--impls", default="gpurl,transformers", help="subset of gpurl,transformers")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch.set_num_threads (default: the cores this process may use)")
    p.add_argument("--smoke", action="store_true", help="the tiny random model (transformers "
                   "loads gpurl's HF export of it), batch 2, 8 + 8 tokens: the script runs")
    p.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "gpurl_generate.json"),
                   help="where to write the results as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches, args.new_tokens, args.prompt_tokens, args.repeats = "2", 8, 8, 1
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = args.modes.split(",")
    args.impls = args.impls.split(",")
    if set(args.modes) - set(MODES) or set(args.impls) - {"gpurl", "transformers"}:
        p.error(f"--modes takes {','.join(MODES)} and --impls takes gpurl,transformers.")
    return args


def make_prompts(tokenizer: Any, batch: int, length: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `length` tokens: bos + a window of TEXT."""
    ids = tokenizer.encode(TEXT)
    stride = max(1, (len(ids) - length) // max(batch, 1))
    rows = [[tokenizer.bos_id] + ids[(i * stride) % (len(ids) - length):][:length - 1]
            for i in range(batch)]
    assert all(len(r) == length for r in rows)
    return rows


# ------------------------------------------------------------------------------ gpurl


def load_gpurl(path: str) -> tuple[Any, Any, Any, Any]:
    """(spec, rollout mesh, sampling rules, parameters) of the GGUF in gpurl, fp32."""
    from gpurl.config import MeshConfig, ModelConfig
    from gpurl.distributed.mesh import rollout_mesh, tree_shardings
    from gpurl.models import model_spec
    from gpurl.models.gguf import load_gguf_params, model_config_from_gguf

    cfg = model_config_from_gguf(path, ModelConfig(name="gemma3_270m", dtype="float32",
                                                   param_dtype="float32"))
    spec, mesh_cfg = model_spec(cfg), MeshConfig()
    mesh = rollout_mesh(mesh_cfg)
    rules = mesh_cfg.sample_rules
    params = load_gguf_params(path, spec, tree_shardings(spec.abstract_params,
                                                         spec.logical_axes, rules, mesh))
    return spec, mesh, rules, params


def load_tiny(hf_dir: Path) -> tuple[Any, Any, Any, Any]:
    """(spec, rollout mesh, sampling rules, parameters) of the tiny random model (fp32),
    exported to `hf_dir` too (transformers' copy of the same weights)."""
    import jax

    from gpurl.cli.compose import validate
    from gpurl.config import MeshConfig
    from gpurl.distributed.mesh import rollout_mesh, tree_shardings
    from gpurl.models import model_spec
    from gpurl.models.hf_export import export_hf

    cfg = validate(["model=tiny", "model.dtype=float32", "model.param_dtype=float32"]).model
    spec, mesh_cfg = model_spec(cfg), MeshConfig()
    mesh, rules = rollout_mesh(mesh_cfg), mesh_cfg.sample_rules
    shardings = tree_shardings(spec.abstract_params, spec.logical_axes, rules, mesh)
    params = jax.jit(lambda: spec.init(0), out_shardings=shardings)()
    export_hf(params, cfg, hf_dir)
    return spec, mesh, rules, params


def gpurl_runner(model: tuple[Any, Any, Any, Any]) -> Runner:
    """gpurl's sampler on `model` (`load_gpurl`'s or `load_tiny`'s); returns run(prompts,
    temperature, seed, new_tokens)."""
    import jax

    from gpurl.config import RolloutConfig
    from gpurl.rollout.static import StaticSampler

    spec, mesh, rules, params = model
    sampler = StaticSampler(spec, RolloutConfig(top_k=0, top_p=1.0), mesh, rules, stop_ids=(), pad_id=0)

    def run(prompts: list[list[int]], temperature: float, seed: int, new_tokens: int) -> None:
        seeds = [seed * len(prompts) + i for i in range(len(prompts))]
        out = sampler.generate(params, prompts, seeds, new_tokens, temperature)
        lengths_B = np.asarray(jax.device_get(out.lengths))[:len(prompts)]
        assert (lengths_B == new_tokens).all(), f"gpurl stopped early: {lengths_B}"

    return run


# ----------------------------------------------------------------------- transformers


@contextlib.contextmanager
def shared_gguf_parse() -> Iterator[None]:
    """transformers parses the GGUF with gguf-py's GGUFReader several times per load (about
    12 s each on 2 cores, as tests/test_gguf.py notes); share one parse of the file."""
    import gguf

    real, parsed = gguf.GGUFReader, {}

    def reader(path: Any, *args: Any) -> Any:
        key = (os.fspath(path),) + args
        if key not in parsed:
            parsed[key] = real(path, *args)
        return parsed[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def transformers_runner(path: str, threads: int) -> Runner:
    """Loads the same GGUF with transformers' own loader (or an HF directory: the tiny
    model's export); returns run(prompts, temperature, seed, new_tokens)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    file = Path(path)
    if file.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(file, dtype=torch.float32).eval()
    else:
        with shared_gguf_parse():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    # generate() fills unset (None) options from the model's generation config, so EOS is
    # removed there; every row then runs to max_new_tokens, as in gpurl.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    def run(prompts: list[list[int]], temperature: float, seed: int, new_tokens: int) -> None:
        torch.manual_seed(seed)
        ids_BxP = torch.tensor(prompts)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        with torch.inference_mode():
            out_BxT = model.generate(
                ids_BxP, attention_mask=torch.ones_like(ids_BxP), max_new_tokens=new_tokens,
                **(sampling if temperature > 0 else dict(do_sample=False)))
        assert out_BxT.shape == (len(prompts), ids_BxP.shape[1] + new_tokens), out_BxT.shape

    return run


# ---------------------------------------------------------------------------- driver


def _importable(*names: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(n) is not None for n in names)


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# New tokens of each warm-up call: gpurl compiles one program per length, so it warms up with
# the timed length; transformers has nothing to compile and warms up with a short call.
WARMUP_TOKENS = {"gpurl": None, "transformers": 2}


def measure(runners: dict[str, Runner], prompts: dict[int, list[list[int]]],
            args: argparse.Namespace) -> list[Cell]:
    """Warm-up of every cell, then `repeats` interleaved rounds over all cells."""
    cells = [Cell(impl, mode, b) for b in args.batches for mode in args.modes for impl in runners]
    compiles = CompileTimer()
    for cell in cells:
        n = WARMUP_TOKENS[cell.impl] or args.new_tokens
        before = compiles.total_s
        cell.warmup_s = timed(
            lambda: runners[cell.impl](prompts[cell.batch], MODES[cell.mode], 0, n))
        cell.compile_s = compiles.total_s - before
        print(f"warm-up {cell.impl:12s} {cell.mode:7s} B={cell.batch:<3d} {cell.warmup_s:7.2f} s",
              flush=True)
    for rep in range(args.repeats):
        for cell in cells:
            cell.times_s.append(timed(lambda: runners[cell.impl](
                prompts[cell.batch], MODES[cell.mode], rep + 1, args.new_tokens)))
        print(f"repetition {rep + 1}/{args.repeats} done", flush=True)
    return cells


def table(cells: list[Cell], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (batch, mode): tokens/s of each implementation and gpurl / transformers."""
    rows = []
    for b in args.batches:
        for mode in args.modes:
            row: dict[str, Any] = {"batch": b, "mode": mode}
            for c in (c for c in cells if (c.batch, c.mode) == (b, mode)):
                row[f"{c.impl}_tok_s"] = round(c.tokens_per_s(args.new_tokens), 2)
                row[f"{c.impl}_best_tok_s"] = round(c.tokens_per_s(args.new_tokens, True), 2)
                row[f"{c.impl}_median_s"] = round(c.median_s(), 4)
                row[f"{c.impl}_warmup_s"] = round(c.warmup_s, 3)
                if c.impl == "gpurl":
                    row["gpurl_compile_s"] = round(c.compile_s, 2)
            if {"gpurl_tok_s", "transformers_tok_s"} <= row.keys():
                row["ratio"] = round(row["gpurl_tok_s"] / row["transformers_tok_s"], 2)
                row["ratio_best"] = round(
                    row["gpurl_best_tok_s"] / row["transformers_best_tok_s"], 2)
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    """Markdown: medians, then the same from each cell's fastest call ("best")."""
    head = ("batch", "mode", "gpurl tok/s", "transformers tok/s", "gpurl/transformers",
            "best gpurl", "best transformers", "best ratio", "gpurl compile s")
    keys = ("batch", "mode", "gpurl_tok_s", "transformers_tok_s", "ratio", "gpurl_best_tok_s",
            "transformers_best_tok_s", "ratio_best", "gpurl_compile_s")
    print("| " + " | ".join(head) + " |")
    print("| --- | --- | " + " | ".join(["---:"] * (len(head) - 2)) + " |")
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")


def environment(args: argparse.Namespace) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)), "torch_threads": args.threads,
            "load_average": os.getloadavg(), "jax": installed("jax"), "torch": installed("torch"),
            "transformers": installed("transformers"), "python": platform.python_version(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpurl_generate_") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> None:
    if args.smoke:
        from gpurl.models.tokenizer import byte_tokenizer

        path, tokenizer = str(tmp / "tiny-hf"), byte_tokenizer()
        tiny = load_tiny(Path(path))  # written first: transformers loads its export
        load = lambda: tiny  # noqa: E731
        if "transformers" in args.impls and not _importable("torch", "transformers"):
            print("transformers: skipped: torch or transformers is not installed")
            args.impls.remove("transformers")
    else:
        from gpurl.models.gguf import default_gemma3_270m_path
        from gpurl.models.gguf_tokenizer import tokenizer_from_gguf

        path = default_gemma3_270m_path()
        tokenizer = tokenizer_from_gguf(path)
        load = lambda: load_gpurl(path)  # noqa: E731
    prompts = {b: make_prompts(tokenizer, b, args.prompt_tokens) for b in args.batches}
    runners, load_s = {}, {}
    if "gpurl" in args.impls:
        load_s["gpurl"] = timed(lambda: runners.update(gpurl=gpurl_runner(load())))
    if "transformers" in args.impls:
        load_s["transformers"] = timed(
            lambda: runners.update(transformers=transformers_runner(path, args.threads)))
    print("model load s: " + ", ".join(f"{k} {v:.1f}" for k, v in load_s.items()), flush=True)
    env = environment(args)
    env["load_s"] = {k: round(v, 1) for k, v in load_s.items()}
    start = time.perf_counter()
    cells = measure(runners, prompts, args)
    rows = table(cells, args)
    env["load_average_end"] = os.getloadavg()
    env["measure_s"] = round(time.perf_counter() - start, 1)
    print_table(rows)
    print(f"load average (1, 5, 15 min) at start {env['load_average']}, at end "
          f"{env['load_average_end']}; {env['cores']} cores; measured in {env['measure_s']} s")
    result = {"settings": {k: v for k, v in vars(args).items() if k != "json"},
              "environment": env, "table": rows, "cells": [asdict(c) for c in cells]}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

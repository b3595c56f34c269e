"""Safetensors reading and writing: gpurl's reader on the `safetensors` package against the
hand-written memory-map reader it replaced, and the streamed writer against the package's.

The script writes one file of about --gb GB (half fp32, half bf16 tensors of 4,096 rows)
into --dir, then runs each measurement in a fresh process, interleaved (old, new; new,
old; ...), and reports medians of --repeats. `shards`: open the file and read every tensor
the way `load_hf_params` does on a (fsdp=2, tp=2) mesh: transposed (an MLP weight) or
transposed and split into 32 heads (an attention weight), each of the 4 device slices
copied out and cast to fp32. `whole`: a copy (`np.array`) of every tensor. `write`: the same
tensors, made one at a time by a callback (a device gather), written by `write_tensors`
(streamed) or by `safetensors.numpy.save_file` (which needs them all at once). Peak RSS
is the process's high-water mark (VmHWM, reset before the operation) above its resident
size before it; it counts the file's pages the reader maps. The old reader is the module
before the change:

    git show d143021:gpurl/models/safetensors_io.py > /tmp/safetensors_io_old.py
    python benchmarks/safetensors_io.py --old /tmp/safetensors_io_old.py --repeats 3
    python benchmarks/safetensors_io.py --smoke   # tensors of 256 rows, once: the script runs
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

GB = 1e9
ROWS, HEADS = 4096, 32
READS = ("shards", "whole")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default="/tmp/safetensors_io_old.py",
                   help="the hand-written module (git show d143021:gpurl/models/safetensors_io.py)")
    p.add_argument("--dir", default="/tmp/gpurl_safetensors_bench", help="where the files go")
    p.add_argument("--gb", type=float, default=1.0, help="approximate file size")
    p.add_argument("--rows", type=int, default=ROWS, help="rows of every tensor")
    p.add_argument("--repeats", type=int, default=3, help="rounds (median)")
    p.add_argument("--json", default="", help="also write the rows and settings here")
    p.add_argument("--child", nargs=3, metavar=("OPERATION", "IMPL", "FILE"),
                   help=argparse.SUPPRESS)  # one measurement, in this process
    p.add_argument("--smoke", action="store_true",
                   help="one tensor of each dtype, 256 rows, once: checks the script end to end")
    args = p.parse_args(argv)
    if args.smoke and not args.child:
        args.rows, args.gb, args.repeats = 256, 0.0, 1
        args.dir = tempfile.mkdtemp(prefix="gpurl_safetensors_smoke_")
        args.old = old_module(Path(args.dir) / "safetensors_io_old.py")
    return args


def old_module(path: Path) -> str:
    """The old reader from git history, or (a shallow checkout) the current one in its place."""
    here = Path(__file__).resolve().parents[1]
    done = subprocess.run(["git", "show", "d143021:gpurl/models/safetensors_io.py"], cwd=here,
                          capture_output=True, text=True)
    if done.returncode != 0:
        print("old reader: skipped (commit d143021 is not in this checkout); the current "
              "module stands in")
        return str(here / "gpurl/models/safetensors_io.py")
    path.write_text(done.stdout)
    return str(path)


def layout(gb: float, rows: int) -> list[tuple[str, Any, tuple[int, int]]]:
    """(name, dtype, shape): equal bytes of fp32 (R x R) and bf16 (R x 2R), R = 4,096."""
    n = max(1, round(gb * GB / 2 / (rows * rows * 4)))
    return ([(f"f32.{i}", np.dtype(np.float32), (rows, rows)) for i in range(n)]
            + [(f"bf16.{i}", np.dtype(ml_dtypes.bfloat16), (rows, 2 * rows)) for i in range(n)])


def make(entry: tuple[str, Any, tuple[int, int]], i: int) -> np.ndarray:
    _, dtype, shape = entry
    return np.full(shape, i + 0.5, np.float32).astype(dtype)


def module(impl: str, old: str) -> ModuleType:
    if impl == "new":
        from gpurl.models import safetensors_io
        return safetensors_io
    spec = importlib.util.spec_from_file_location("safetensors_io_old", old)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_shards(st: ModuleType, file: Path) -> float:
    total = 0.0
    for k, view in enumerate(st.open_checkpoint(file).values()):
        rows, cols = view.shape[1], view.shape[0]  # HF [out, in] -> gpurl [in, out]
        w = view.T if k % 2 else view.T.reshape(rows, HEADS, cols // HEADS)
        halves = [w.shape[1] // 2 * j for j in range(3)]
        for r in range(2):
            for c in range(2):
                index = (slice(r * rows // 2, (r + 1) * rows // 2), slice(halves[c], halves[c + 1]))
                total += float(np.array(w[index], np.float32, order="C").flat[0])
    return total


def read_whole(st: ModuleType, file: Path) -> float:
    return sum(float(np.array(v).flat[0]) for v in st.open_checkpoint(file).values())


def write(st: ModuleType, impl: str, file: Path, gb: float, rows: int) -> float:
    entries = layout(gb, rows)
    fetch: Callable[[int], np.ndarray] = lambda i: make(entries[i], i)  # noqa: E731
    out = file.with_name("written.safetensors")
    if impl == "streamed":
        st.write_tensors(out, entries, fetch)
    else:
        safetensors.numpy.save_file({e[0]: fetch(i) for i, e in enumerate(entries)}, out)
    size = out.stat().st_size
    out.unlink()
    return float(size)


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}; this script measures memory on Linux.")


def reset_peak_rss() -> None:
    """Restart VmHWM from the current RSS (Linux >= 4.0). `ru_maxrss` cannot be used: it
    keeps the high-water mark of the parent that spawned this process."""
    Path("/proc/self/clear_refs").write_text("5")


def child(operation: str, impl: str, file: Path, args: argparse.Namespace) -> None:
    st = module(impl if operation in READS else "new", args.old)  # imports stay untimed
    os.sync()  # no writeback of an earlier run's pages during this one
    reset_peak_rss()
    before = status_kb("VmRSS")
    start = time.perf_counter()
    if operation == "shards":
        check = read_shards(st, file)
    elif operation == "whole":
        check = read_whole(st, file)
    else:
        check = write(st, impl, file, args.gb, args.rows)
    seconds = time.perf_counter() - start
    peak = status_kb("VmHWM")
    print(json.dumps({"seconds": seconds, "peak_gb": (peak - before) * 1024 / GB,
                      "check": check}))


def measure(operation: str, impl: str, file: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", operation, impl, str(file), "--old", args.old,
           "--gb", str(args.gb), "--rows", str(args.rows)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {"operation": operation, "impl": impl, **json.loads(out.strip().splitlines()[-1])}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for operation, impl in dict.fromkeys((r["operation"], r["impl"]) for r in runs):
        mine = [r for r in runs if (r["operation"], r["impl"]) == (operation, impl)]
        if len({r["check"] for r in mine}) != 1 or (operation in READS and {
                r["check"] for r in runs if r["operation"] == operation} != {mine[0]["check"]}):
            raise SystemExit(f"{operation}: the implementations read different values")
        rows.append({"operation": operation, "impl": impl, "runs": len(mine),
                     "median_s": statistics.median(r["seconds"] for r in mine),
                     "peak_gb": statistics.median(r["peak_gb"] for r in mine),
                     "check": mine[0]["check"]})
    for r in rows:
        base = next(b for b in rows if b["operation"] == r["operation"])
        r["time_ratio"] = r["median_s"] / base["median_s"]
        r["peak_ratio"] = r["peak_gb"] / base["peak_gb"] if base["peak_gb"] else float("nan")
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| operation | implementation | median s | peak RSS GB | time vs first | RSS vs first |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['operation']} | {r['impl']} | {r['median_s']:.3f} | {r['peak_gb']:.2f} "
              f"| {r['time_ratio']:.2f} | {r['peak_ratio']:.2f} |")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        operation, impl, file = args.child
        return child(operation, impl, Path(file), args)
    if not Path(args.old).is_file():
        raise SystemExit(f"--old {args.old} does not exist; write it with `git show "
                         f"d143021:gpurl/models/safetensors_io.py > {args.old}`.")
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    file = root / "model.safetensors"
    entries = layout(args.gb, args.rows)
    safetensors.numpy.save_file({e[0]: make(e, i) for i, e in enumerate(entries)}, file)
    print(f"{file}: {file.stat().st_size / GB:.2f} GB, {len(entries)} tensors", flush=True)
    file.read_bytes()  # into the page cache before the first timed read
    runs = []
    for repeat in range(args.repeats):
        for operation, impls in [*((op, ("old", "new")) for op in READS),
                                 ("write", ("streamed", "package"))]:
            for impl in impls if repeat % 2 == 0 else impls[::-1]:
                runs.append(measure(operation, impl, file, args))
                print(json.dumps(runs[-1]), flush=True)
    rows = summarize(runs)
    print_table(rows)
    file.unlink()
    if args.json:
        env = {"python": platform.python_version(), "numpy": np.__version__,
               "safetensors": safetensors.__version__, "date": datetime.date.today().isoformat()}
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "environment": env, "runs": runs, "rows": rows},
                      f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

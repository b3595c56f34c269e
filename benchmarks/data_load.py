"""Load time and memory of a large data file: a generated N-row parquet file read by
`load_prompts` (gpurl: `datasets`, memory-mapped, lazy rows) against the same file read
into Python dicts (`pandas.read_parquet(...).to_dict("records")`, what a list-based loader
holds). Each reader runs in a fresh process; peak RSS is VmHWM, reset before reading.

    .venv/bin/python benchmarks/data_load.py --rows 1000000
    .venv/bin/python benchmarks/data_load.py --smoke     # 1,000 rows once: the script runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

READERS = {
    "gpurl load_prompts": (
        "from gpurl.config import DataConfig\n"
        "from gpurl.data.sources import load_prompts\n"
        "train, eval_ = load_prompts(DataConfig(name='jsonl', path=PATH, num_eval=200))\n"
        "assert len(train) + len(eval_) == ROWS and train[len(train) - 1]['answer']\n"),
    "python dicts (pandas)": (
        "import pandas\n"
        "rows = pandas.read_parquet(PATH).to_dict('records')\n"
        "assert len(rows) == ROWS\n"),
}
CHILD = """
import time, re
open('/proc/self/clear_refs', 'w').write('5')
t = time.perf_counter()
PATH, ROWS = {path!r}, {rows}
{code}
seconds = time.perf_counter() - t
hwm = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))
print(seconds, hwm / 2**20)
"""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="1,000 rows once: the script runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.repeats = 1000, 1
    tmp = Path(tempfile.mkdtemp())
    path = str(tmp / "big.parquet")
    import datasets
    datasets.Dataset.from_dict({
        "prompt": [f"Question {i}: what is {i} + 17? Think, then answer." for i in range(args.rows)],
        "answer": [str(i + 17) for i in range(args.rows)],
        "data_source": ["generated"] * args.rows}).to_parquet(path)
    results = {name: [] for name in READERS}
    for repeat in range(args.repeats):  # interleaved; the first gpurl read builds the cache
        for name, code in READERS.items():
            out = subprocess.run([sys.executable, "-c", CHILD.format(path=path, rows=args.rows,
                                                                     code=code)],
                                 capture_output=True, text=True, check=True)
            results[name].append(tuple(map(float, out.stdout.split()[-2:])))
    print(f"{args.rows:,} rows, {Path(path).stat().st_size / 2**20:.0f} MiB parquet; medians of "
          f"{args.repeats} (gpurl's first read converts to datasets' Arrow cache: "
          f"{results['gpurl load_prompts'][0][0]:.1f} s)")
    print("| reader | load s | peak RSS GiB |\n|---|---|---|")
    for name, runs in results.items():
        print(f"| {name} | {statistics.median(r[0] for r in runs):.2f} | "
              f"{statistics.median(r[1] for r in runs):.2f} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""Every script in benchmarks/ runs its smoke form (`--smoke`: the tiny random model or tiny
sizes, a few steps, on CPU, its table printed; a peer library that is absent is skipped with
a one-line note), so a benchmark broken by a change elsewhere fails here instead of rotting
unseen until someone next runs it.

All smoke forms run in ONE child process (this file run as a script, `python
tests/test_benchmarks.py [NAME ...]`): it imports each benchmark module and calls its
`main(["--smoke"])`, so JAX is imported once and the in-process scripts share jitted
programs; the `gpurl train` runs and workers some scripts start share the session's
persistent compilation cache (tests/conftest.py). The scripts are found in benchmarks/, so
a new script without a smoke form fails the test. `benchmarks/gpu.sh --cpu-smoke` has its
own test (tests/test_gpu.py), which runs the smoke forms of the scripts it calls
(BY_GPU_SH), so they are not run twice; setup_vllm.sh builds a virtualenv and has none.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
MARK = "=== smoke"  # the runner's lines: "=== smoke NAME ===", "=== smoke NAME: passed in S s"


# benchmarks/gpu.sh --cpu-smoke passes --smoke to these (tests/test_gpu.py checks its table)
BY_GPU_SH = ("decode", "grpo_step", "rl_step", "train_step")


def scripts() -> list[Path]:
    return sorted(p for p in BENCHMARKS.glob("*.py") if p.stem not in BY_GPU_SH)


def run_one(path: Path) -> bool:
    """Imports benchmarks/NAME.py under its own name (its neighbours import it so: `from
    packing import ...`) and calls main(["--smoke"]); prints how it went."""
    print(f"{MARK} {path.stem} ===", flush=True)
    t0 = time.perf_counter()
    try:
        module = sys.modules.get(path.stem)
        if getattr(module, "__file__", None) != str(path):
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        module.main(["--smoke"])
    except BaseException:  # SystemExit too: argparse refusing --smoke is a failure
        sys.stdout.flush()
        traceback.print_exc()
        print(f"{MARK} {path.stem}: FAILED", flush=True)
        return False
    print(f"{MARK} {path.stem}: passed in {time.perf_counter() - t0:.1f} s", flush=True)
    return True


def sections(output: str) -> dict[str, str]:
    """The runner's output cut into each script's part (its status line included)."""
    parts: dict[str, str] = {}
    name = None
    for line in output.splitlines(keepends=True):
        words = line.split()
        if line.startswith(MARK) and len(words) == 4 and words[3] == "===":
            name = words[2]
            parts[name] = ""
        elif name is not None:
            parts[name] += line
    return parts


def test_gpu_sh_runs_the_smoke_forms_left_to_it():
    """The scripts this test leaves out run their own smoke forms in `gpu.sh --cpu-smoke`."""
    text = (BENCHMARKS / "gpu.sh").read_text()
    smoke = text[text.index('if [ $SMOKE = 1 ]; then'):text.index("else")]
    for name in BY_GPU_SH:
        assert f"benchmarks/{name}.py" in text, name
    for args in ("TRAIN_ARGS", "DECODE_GEMMA_ARGS", "DECODE_QWEN_ARGS", "RL_ARGS", "GRPO_ARGS"):
        assert f'{args}="--smoke"' in smoke or f'{args}="--smoke ' in smoke, args


@pytest.mark.slow
def test_every_benchmark_runs_its_smoke_form():
    """Each script passes its smoke form and prints a markdown table (or, where everything
    it measures is absent here, a `skipped:` note)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # 4 host devices, as the suite (benchmarks/context.py splits rows over 4)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=xla_flags(4))
    run = subprocess.run([sys.executable, __file__], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env, timeout=1500)
    parts = sections(run.stdout)
    problems = []
    for path in scripts():
        text = parts.get(path.stem)
        if text is None:
            problems.append(f"{path.name}: never ran; the runner's output ends:\n"
                            + run.stdout[-3000:])
        elif f"{MARK} {path.stem}: passed" not in text:
            problems.append(f"{path.name} failed its smoke form (`python benchmarks/{path.name} "
                            f"--smoke`); its output ends:\n" + text[-3000:])
        elif "| ---" not in text and "|---" not in text and "skipped:" not in text:
            problems.append(f"{path.name}: its smoke form printed no table:\n" + text[-1500:])
    assert not problems, "\n\n".join(problems)
    assert run.returncode == 0, run.stdout[-3000:]


if __name__ == "__main__":
    sys.path.insert(0, str(BENCHMARKS))  # scripts import their neighbours (generate, decode)
    names = set(sys.argv[1:])
    passed = [run_one(path) for path in scripts() if not names or path.stem in names]
    sys.exit(0 if all(passed) else 1)

"""XLA's GPU compiler for tests on a machine without a GPU (`gpurl plan plan.target=...`).

The `gpu-plan` extra's packages are installed once with `pip install --target` into
`<the test virtualenv>/gpu-compiler` (about 1 GB from the index, 2.7 GB on disk; reused
while its requirement list is unchanged) and put on the PYTHONPATH of `gpurl`
subprocesses only: the test process and every other test keep a JAX without a CUDA plugin.
The extra's `jax[cuda12-local]` is installed as what it brings beside an installed JAX,
`jax-cuda12-plugin` at that JAX's version (`--target` would otherwise install a second
JAX, NumPy and SciPy into the folder). Skips when the index cannot be reached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from packaging.requirements import Requirement

from pip_index import ROOT, network_error, pip, tail

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

EXTRA = "gpu-plan"
FOLDER = Path(sys.prefix) / "gpu-compiler"
NOISE = ("cudart_stub.cc", "absl::InitializeLog", "cuda_platform.cc")  # no driver: expected


def requirements() -> list[str]:
    """The extra's requirements, with `jax[cuda12-local]` as the plugin at JAX's version."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    out = []
    for line in extras[EXTRA]:
        req = Requirement(line)
        if req.name == "jax":
            assert req.extras == {"cuda12-local"}, f"{EXTRA}: unexpected {line}"
            out.append(f"jax-cuda12-plugin=={jax.__version__}")
        else:
            out.append(line)
    return out


def install() -> Path:
    """The folder holding the compiler packages, installed if missing (skip: no index)."""
    wanted = "\n".join(requirements())
    stamp = FOLDER / ".requirements"
    if stamp.exists() and stamp.read_text() == wanted:
        return FOLDER
    rc, out = pip("install", "--quiet", "--upgrade", "--target", str(FOLDER), *wanted.split("\n"),
                  timeout=900)
    if rc != 0:
        if (err := network_error(out)) is not None:
            pytest.skip(f"package index unreachable (pip install {EXTRA}): {err}")
        pytest.fail(f"pip install --target {FOLDER} of .[{EXTRA}] failed (rc {rc}):\n{tail(out)}")
    stamp.write_text(wanted)
    return FOLDER


def gpurl(folder: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`gpurl *args` in a fresh process that sees the compiler packages; the CUDA runtime's
    complaints about the missing driver are dropped from its stderr."""
    return python(folder, "-m", "gpurl.cli", *args, timeout=timeout)


def python(folder: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python *args` in a fresh process that sees the compiler packages (as `gpurl`)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    done.stderr = "\n".join(ln for ln in done.stderr.splitlines()
                            if not any(n in ln for n in NOISE))
    return done

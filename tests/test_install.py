"""The GPU extras resolve against the package index: `pip install --dry-run -e ".[cuda12]"`
(and `.[cuda13]`) gives jax, jaxlib, the CUDA plugin and its PJRT at one JAX version inside
pyproject.toml's jax pin, plus every NVIDIA runtime wheel of the plugin's `with-cuda` extra,
of the right CUDA major, with cuDNN 9. Nothing is installed. `--use-feature=fast-deps` reads
each wheel's metadata with HTTP range requests where the index serves no PEP 658 metadata,
instead of downloading ~3 GB of CUDA wheels per extra. Skipped only when the index cannot be
reached; a resolution failure fails with pip's output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from pip_index import network_error, pip, tail

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# `slow` as well: two subprocesses of ~30 s each, kept out of `make test-fast`.
pytestmark = [pytest.mark.index, pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux",
                                 reason="JAX's CUDA wheels exist for Linux only")]

def _jax_pin() -> SpecifierSet:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [Requirement(d).specifier for d in deps if Requirement(d).name == "jax"]
    assert len(pins) == 1, f"pyproject.toml should list jax once in dependencies: {deps}"
    return pins[0]


def _dry_run(extra: str, report: Path) -> dict:
    plugin = f"jax-{extra}-plugin"
    # Reachability, narrowly: the plugin is on the index only (jax and jaxlib may also be in
    # local find-links, so probing them would pass offline).
    rc, out = pip("index", "versions", plugin, "--retries", "1", "--timeout", "20", timeout=120)
    if rc != 0:
        if (err := network_error(out)) is not None:
            pytest.skip(f"package index unreachable (pip index versions {plugin}): {err}")
        pytest.fail(f"pip index versions {plugin} failed (rc {rc}):\n{tail(out)}")

    # --ignore-installed: resolve a fresh environment, so the report lists every distribution
    # (jax and jaxlib installed here would otherwise be left out of it). No --quiet: pip's
    # "The conflict is caused by" lines are info-level, and a failure shows them.
    args = ["install", "--dry-run", "--ignore-installed", "--report", str(report),
            "--use-feature=fast-deps", "-e", f"{ROOT}[{extra}]"]
    rc, out = pip(*args, timeout=600)
    if rc != 0 and "invalid choice: 'fast-deps'" in out:  # a pip without the feature
        args.remove("--use-feature=fast-deps")
        rc, out = pip(*args, timeout=600)
    if rc != 0:
        err = network_error(out)
        if err is not None and "ResolutionImpossible" not in out and "conflict" not in out.lower():
            pytest.skip(f"package index became unreachable during the dry run: {err}")
        pytest.fail(f"pip install --dry-run -e .[{extra}] failed (rc {rc}):\n{tail(out)}")
    return json.loads(report.read_text())


@pytest.mark.parametrize("extra", ["cuda12", "cuda13"])
def test_gpu_extra_resolves_to_one_jax_version_with_its_cuda_wheels(extra, tmp_path):
    major = int(extra.removeprefix("cuda"))
    report = _dry_run(extra, tmp_path / "report.json")
    resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]
                for item in report["install"]}
    version = {name: Version(meta["version"]) for name, meta in resolved.items()}

    plugin, pjrt = f"jax-cuda{major}-plugin", f"jax-cuda{major}-pjrt"
    jax_parts = ["jax", "jaxlib", plugin, pjrt]
    missing = [name for name in jax_parts if name not in version]
    assert not missing, f".[{extra}] resolved without {missing}: {sorted(version)}"
    jaxlib = version["jaxlib"]
    assert {name: version[name] for name in jax_parts} == dict.fromkeys(jax_parts, jaxlib), (
        f"JAX parts at different versions: { {n: str(version[n]) for n in jax_parts} }")
    pin = _jax_pin()
    assert pin.contains(jaxlib, prereleases=True), f"jax {jaxlib} outside pyproject's pin {pin}"

    # The NVIDIA runtime wheels: every requirement of the plugin's `with-cuda` extra that
    # applies to the report's environment is resolved, within its specifier.
    env = {**report["environment"], "extra": "with-cuda"}
    wanted = [Requirement(r) for r in resolved[plugin].get("requires_dist") or []]
    wanted = [r for r in wanted if r.marker is not None and "with-cuda" in str(r.marker)
              and r.marker.evaluate(env)]
    assert wanted, f"{plugin} {jaxlib} lists no with-cuda requirements"
    bad = [f"{r} -> {version.get(canonicalize_name(r.name), 'missing')}" for r in wanted
           if canonicalize_name(r.name) not in version
           or not r.specifier.contains(version[canonicalize_name(r.name)], prereleases=True)]
    assert not bad, f"{plugin}[with-cuda] not satisfied: {bad}"

    cudnn = f"nvidia-cudnn-cu{major}"
    assert cudnn in version and version[cudnn].major == 9, (
        f"cuDNN 9 expected, got {cudnn} {version.get(cudnn, 'missing')}")
    # CUDA 13 wheels dropped the -cu13 suffix for most libraries (nvidia-cuda-runtime).
    runtime = next((n for n in (f"nvidia-cuda-runtime-cu{major}", "nvidia-cuda-runtime")
                    if n in version), None)
    assert runtime is not None, f"no CUDA runtime wheel in .[{extra}]: {sorted(version)}"
    assert version[runtime].major == major, f"{runtime} {version[runtime]} is not CUDA {major}"

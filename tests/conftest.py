"""Test setup: 4 forced host devices (so sharding is real) before JAX is imported, one
compilation cache for the session, and small shared builders so tests reuse compiled
functions instead of recompiling."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# XLA's CPU compiler with its costly optimizations off, for every program the suite compiles,
# in this process and in every process a test starts (`xla_flags`): the tests check what the
# programs compute, never how fast they run, and these tiny programs spend most of their
# time in the compiler (LLVM at -O0 and the older elemental fusion emitters: the unit tier
# 160 s -> 98 s on 2 cores). The floating-point semantics are the same (XLA's fast-math
# stays off either way). GPURL_TEST_XLA_FLAGS="" runs the suite with XLA's default flags.
COMPILE_XLA_FLAGS = os.environ.get(
    "GPURL_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false")


def xla_flags(devices: int | None = 4) -> str:
    """XLA_FLAGS for a process of the suite: `devices` host devices (None: JAX's default,
    one) and the suite's compiler flags."""
    count = f"--xla_force_host_platform_device_count={devices}" if devices else ""
    return f"{count} {COMPILE_XLA_FLAGS}".strip()


if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(4)}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One OpenMP thread for torch (transformers' references) and NumPy's BLAS: `make test` runs a
# pytest worker per core, and a second OpenMP thread spins waiting for a core the other
# worker holds (the real model's greedy reference took 61 s in the suite instead of 3 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test reaches the network: the Hugging Face Hub is offline, and its cache is an empty
# folder of this session (a test that needs a cached model or dataset builds one, and the
# download path is tested against a loopback server: tests/test_hub.py).
os.environ["HF_HUB_OFFLINE"] = "1"
_hf_home = tempfile.mkdtemp(prefix="gpurl-test-hf-home-")
atexit.register(shutil.rmtree, _hf_home, ignore_errors=True)
os.environ["HF_HOME"] = _hf_home
os.environ.pop("HF_HUB_CACHE", None)
# JAX's persistent compilation cache, empty at the start of each session (as on CI) and
# shared by the test process and every process a test starts (they inherit the variable):
# many tests compile the same tiny programs, in-process and in `gpurl` subprocesses (a
# resumed run, 1 against 2 processes, every early exit), and XLA compiles each once.
# Compiled programs are the same either way; JAX keys them by the program, its devices and
# the compiler flags. JAX_COMPILATION_CACHE_DIR set outside keeps that folder.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="gpurl-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# A size limit turns on the cache's file lock, so that no process reads an entry another is
# still writing (`make test` runs 2 pytest workers, and tests start `gpurl` processes).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(32 << 30))

# Every process of the session records itself and its compiles in one ledger, read at the
# end against each tier's ceilings (tests/suite_budget.py, tests/budget.json).
from suite_budget import BudgetPlugin, start_ledger  # noqa: E402

start_ledger()

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import pytest  # noqa: E402

from gpurl.algorithms import registry  # noqa: E402
from gpurl.config import Config  # noqa: E402


def make_config(**groups: dict[str, Any]) -> Config:
    """Config() with per-group field overrides: make_config(train={"steps": 3}); `algo`
    takes the fields of its algorithm's schema (by `name`), `rewards` a list of function
    names (or a dict of RewardsConfig fields)."""
    cfg = Config()
    for group, values in groups.items():
        if group == "algo":
            value = registry.get(values.get("name", cfg.algo.name)).config(**values)
        elif group == "rewards" and not isinstance(values, dict):
            value = dataclasses.replace(cfg.rewards, functions=tuple(values))
        else:
            value = dataclasses.replace(getattr(cfg, group), **values)
        cfg = dataclasses.replace(cfg, **{group: value})
    return cfg


def algo_config(name: str, **fields: Any) -> Any:
    """The config of algorithm `name` (its registry record's schema) with `fields` set."""
    return registry.get(name).config(name=name, **fields)


def with_rewards(cfg: Config, *functions: str, **fields: Any) -> Config:
    """`cfg` with other reward functions (and RewardsConfig fields such as on_error)."""
    return dataclasses.replace(cfg, rewards=dataclasses.replace(
        cfg.rewards, **({"functions": functions} if functions else {}), **fields))


TINY_MODEL = {"vocab_size": 259, "d_model": 32, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "head_dim": 8, "mlp_dim": 64, "dtype": "float32"}


def tiny_teacher(path: Path, model: dict[str, Any], seed: int, edit: Any = None) -> Path:
    """An HF directory (`gpurl export`'s layout) of a random model with `model`'s fields,
    drawn from `seed` (and changed by `edit(params) -> params`): a teacher for
    distillation tests."""
    from gpurl.models.hf_export import export_hf
    from gpurl.models.spec import model_spec

    cfg = make_config(model=model).model
    params = model_spec(cfg).init(seed)
    export_hf(edit(params) if edit else params, cfg, path)
    return path


# Fixtures of the real model: a test that uses one (directly or through another) is in the
# `realmodel` tier.
REAL_MODEL_FIXTURES = ("gemma3_gguf", "gemma3_hf_model", "gemma3_hf_tokenizer")


# `make test` runs 2 pytest-xdist workers. Each test file runs on one worker (its module
# fixtures are built once); the files of a group below run on one worker, one after
# another, and the groups are handed out first (they are the longest):
# - processes: tests that start a Slurm cluster or several `jax.distributed` processes;
#   two such runs at once would compete for the 2 cores, and their collectives give up
#   on a peer that is late by 30 s;
# - realmodel: tests of the real model, which share the session's transformers model
#   (40 s to build, one copy in memory).
WORKER_GROUPS = {
    "processes": ("test_multiprocess.py", "test_lora.py", "test_slurm.py", "test_sweep_slurm.py"),
    "realmodel": ("test_gguf.py", "test_sampler.py", "test_gpu.py"),
}
GROUP_MARKERS = {"processes": ("multiprocess", "slurm"), "realmodel": ("realmodel",)}
_GROUP_OF_FILE = {f: group for group, files in WORKER_GROUPS.items() for f in files}


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(BudgetPlugin(config), "suite_budget")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in REAL_MODEL_FIXTURES):
            item.add_marker(pytest.mark.realmodel)
    for item in items:
        for group, markers in GROUP_MARKERS.items():
            if (any(item.get_closest_marker(m) for m in markers)
                    and _GROUP_OF_FILE.get(item.path.name) != group):
                raise pytest.UsageError(
                    f"{item.nodeid} is a {'/'.join(markers)} test; add {item.path.name} to "
                    f"WORKER_GROUPS[{group!r}] in tests/conftest.py.")
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the groups' files first
        order = [*WORKER_GROUPS, None]
        items.sort(key=lambda item: order.index(_GROUP_OF_FILE.get(item.path.name)))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Work units of one file or one group's files, in the order the workers collected
    them (the groups first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return _GROUP_OF_FILE.get(Path(file).name, file)

    config.option.loadscopereorder = False
    return ByGroup(config, log)


@pytest.fixture
def tiny_config():
    return make_config


@pytest.fixture(scope="session")
def gemma3_gguf():
    """Path of the real Gemma 3 270M GGUF from the PyPI package (assembled once per session)."""
    from gpurl.models.gguf import default_gemma3_270m_path

    return Path(default_gemma3_270m_path())


@pytest.fixture(scope="session")
def one_gguf_parse(gemma3_gguf: Path) -> Iterator[None]:
    """transformers parses the file with gguf-py's GGUFReader once for the tokenizer and twice
    for the model, 12 s each on 2 cores; share one parse of the unchanged file. Only the
    packaged file (fixed by its SHA-256) is shared, so files that tests write are read afresh."""
    gguf = pytest.importorskip("gguf")
    real, cache = gguf.GGUFReader, {}

    def shared_reader(path: Any, *args: Any) -> Any:
        key = (os.fspath(path),) + args
        if key[0] != os.fspath(gemma3_gguf):
            return real(path, *args)
        if key not in cache:
            cache[key] = real(path, *args)
        return cache[key]

    patch = pytest.MonkeyPatch()
    patch.setattr(gguf, "GGUFReader", shared_reader)
    yield
    patch.undo()


@pytest.fixture(scope="session")
def gemma3_hf_tokenizer(gemma3_gguf: Path, one_gguf_parse: None) -> Any:
    """transformers' tokenizer rebuilt from the GGUF (the reference for gpurl's)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)


@pytest.fixture(scope="session")
def gemma3_hf_model(gemma3_gguf: Path, one_gguf_parse: None) -> Any:
    """transformers' float32 model from the GGUF, dequantized by its own loader (~40 s)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    return transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_gguf.parent, gguf_file=gemma3_gguf.name, dtype=torch.float32).eval()

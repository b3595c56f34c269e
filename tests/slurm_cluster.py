"""A private single-node Slurm on loopback for tests: munged, slurmctld and slurmd from the
Debian packages (munge, slurmctld, slurmd, slurm-client), started as child processes of the
test session with every file (key, sockets, state, spool, logs, pid files) in one temp dir.

Nothing system-wide is read or written: the daemons get their own slurm.conf (passed with
`-f` and SLURM_CONF), their own munge socket (`AuthInfo=socket=...`), free ports, and no
systemd, cgroups or MPI plugins, so this runs in a container and beside a real Slurm.
Commands reach it only through `LocalSlurm.env()`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sinfo", "squeue", "scancel")
PACKAGES = "munge slurmctld slurmd slurm-client"
_SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
# JAX's Slurm cluster puts the coordinator on port 61440 + SLURM_JOB_ID % 4096.
_JAX_PORT_BASE, _JAX_PORT_SPAN = 65535 - 2**12 + 1, 2**12


def _which(name: str) -> str | None:
    return shutil.which(name, path=_SBIN_PATH)


def missing_reason() -> str | None:
    """Why a private Slurm cannot start here (None when it can)."""
    missing = [name for name in DAEMONS + CLIENTS if _which(name) is None]
    if missing:
        return (f"Slurm binaries not found: {', '.join(missing)}; install the Debian packages "
                f"{PACKAGES} (`make test` does it when run as root with apt-get).")
    if os.geteuid() != 0:
        return "a private slurmd must run as root to launch tasks; run the Slurm tests as root."
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_job_id() -> int:
    """A first job id whose JAX coordinator port is free now, so two test sessions on one
    machine (each with its own Slurm counting jobs from FirstJobId) do not collide."""
    for _ in range(50):
        offset = int.from_bytes(os.urandom(2), "little") % _JAX_PORT_SPAN
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", _JAX_PORT_BASE + offset))
            except OSError:
                continue
        return _JAX_PORT_SPAN + offset
    raise RuntimeError(f"no free port in {_JAX_PORT_BASE}..65535 for JAX's coordinator.")


def _node_memory_mb() -> int:
    """RealMemory as slurmd reports it (`slurmd -C`), with a small fallback."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True).stdout
    found = re.search(r"RealMemory=(\d+)", out)
    return int(found.group(1)) if found else 1024


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else ["(no file)"]
    return f"--- {path.name}\n" + "\n".join(text[-lines:])


class LocalSlurm:
    """Owns the temp dir and the three daemon processes; `stop()` ends only those."""

    def __init__(self, root: Path, cpus: int) -> None:
        self.root, self.cpus = root, cpus
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.logs = root / "log"
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self, **extra: str) -> dict[str, str]:
        """The caller's environment pointed at this cluster. SLURM_* variables of an
        enclosing job are dropped, or srun would try to add a step to that job here."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(SLURM_CONF=str(self.conf), PATH=_SBIN_PATH, **extra)
        return env

    def write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        os.chmod(self.root / "munge", 0o755)  # munged wants its socket dir traversable
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=gpurltest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"FirstJobId={_first_job_id()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc",  # no cgroups in a container
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "KillWait=5",
            # the node's CPUs/memory are what this file says, not what slurmd detects, so a
            # 1-core machine still runs 2 tasks and the node is never drained for a mismatch
            "SlurmdParameters=config_overrides",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={self.logs}/slurmctld.log",
            f"SlurmdLogFile={self.logs}/slurmd.log",
            f"NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=localhost CPUs={self.cpus} "
            f"RealMemory={_node_memory_mb()} State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.logs / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen([_which(name), *args], env=self.env(), cwd=self.root,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        log.close()

    def start(self, timeout_s: float = 30.0) -> None:
        self.write_config()
        m = self.root / "munge"
        self._spawn("munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                    f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid",
                    f"--seed-file={m}/munged.seed", f"--log-file={self.logs}/munged.log")
        self._wait(lambda: self.munge_socket.exists(), "munged to create its socket", timeout_s)
        self._spawn("slurmctld", "-D", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-f", str(self.conf), "-N", "localhost")
        self._wait(self._node_idle, "the node to be idle in sinfo", timeout_s)

    def _node_idle(self) -> bool:
        out = subprocess.run([_which("sinfo"), "-h", "-n", "localhost", "-o", "%t"],
                             env=self.env(), capture_output=True, text=True, timeout=10)
        return out.returncode == 0 and out.stdout.strip() == "idle"

    def _wait(self, ready, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"{timeout_s:.0f} s passed"
                raise RuntimeError(f"local Slurm did not start: waited for {what}, but {why}.\n"
                                   + self.log_tails())
            time.sleep(0.2)

    def log_tails(self) -> str:
        return "\n".join(_tail(p) for p in sorted(self.logs.glob("*")))

    def stop(self) -> None:
        """Cancels this cluster's jobs, then ends the daemons (newest first) by their pids."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run([_which("scancel"), "--full", "--partition=debug"], env=self.env(),
                           capture_output=True, timeout=10)
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def local_slurm() -> Iterator[LocalSlurm]:
    """A running private Slurm for the whole session (skips when it cannot exist here)."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="gpurl-slurm-"))
    cluster = LocalSlurm(root, cpus=max(os.cpu_count() or 1, 2))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)

"""pip against the package index, for the tests that need it (marker `index`): a run of
pip with its output, and the connection failures that make such a test skip rather than
fail (this machine, or CI, without a route to the index)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What pip (urllib3) prints when the index cannot be reached: refused, no route, DNS, proxy,
# timeouts. Anything else that fails is the test's business.
NETWORK_ERRORS = ("NewConnectionError", "NameResolutionError", "ConnectTimeoutError",
                  "ProxyError", "Max retries exceeded", "Network is unreachable",
                  "Temporary failure in name resolution", "Name or service not known",
                  "Connection refused", "Read timed out", "connection error")


def pip(*args: str, timeout: float) -> tuple[int, str]:
    """(exit status, stdout + stderr) of `python -m pip *args` in the repository."""
    env = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:  # its captured output is bytes even with text=True
        out = b"".join(part or b"" for part in (e.stdout, e.stderr)).decode(errors="replace")
        return -1, out + f"\n(pip did not finish within {timeout:.0f} s)"
    return done.returncode, done.stdout + done.stderr


def network_error(out: str) -> str | None:
    """The first line of pip's output naming a connection failure, or None."""
    for line in out.splitlines():
        if any(sig in line for sig in NETWORK_ERRORS):
            return line.split("connection broken by ")[-1].strip(" '")[:160]
    return None


def tail(out: str, lines: int = 40) -> str:
    # Local find-links / file indexes without a project print one warning per name: noise.
    kept = [ln for ln in out.splitlines() if "it is neither a file nor a directory" not in ln]
    return "\n".join(kept[-lines:])

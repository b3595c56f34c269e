"""Every program of a run lowered for another platform, on this machine, from abstract
arrays: the CUDA lowering of a GPU run checked on a CPU-only machine (CI has no GPU).

`lower(cfg, "cuda")` builds the run as `gpurl plan` does (nothing allocated) with the GPU's
choices (`gpurl.kernels.platform.target`: attention `auto` -> cuDNN, Pallas kernels
compiled by Triton instead of interpreted, ragged MoE matmuls, bf16 for `model.dtype=auto`),
then traces each program (the train step, and the stepper's own: eval step, RL prepare,
rollout prefill and decode chunk, preference log-probs) and lowers it with
`lowering_platforms=("cuda",)` under the run's mesh of this machine's devices. A primitive
without a CUDA lowering rule (a Pallas op Triton cannot take, a CPU-only custom call) fails
here, as it would on the first step on a GPU. Compilation (XLA's GPU compiler, which
needs a GPU or a target description) is not part of it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from jax._src.cudnn import fused_attention_stablehlo as _cudnn_attention

from gpurl.config import Config
from gpurl.kernels import platform
from gpurl.train.loop import build
from gpurl.train.plan import abstract, sharded

# The GPU a CUDA lowering is traced for when no CUDA plugin is installed (a CPU machine):
# cuDNN 9.28, what the cuda12 and cuda13 extras resolve to (tests/test_install.py), on a
# Hopper GPU (compute capability 9.0: H100 / H200).
DECLARED_CUDNN = 92800
DECLARED_CAPABILITY = (9, 0)

# gpurl's platform name for each lowering platform
BACKENDS = {"cuda": "gpu", "rocm": "gpu", "cpu": "cpu", "tpu": "tpu"}


@dataclass(frozen=True)
class Lowered:
    """One program lowered for a platform: its name, and its StableHLO text."""

    name: str
    text: str

    def count(self, fragment: str) -> int:
        return self.text.count(fragment)


def programs(cfg: Config) -> list[tuple[str, Any, tuple]]:
    """(name, jitted function, abstract arguments) of every program the run `cfg` runs,
    built with the current platform's choices (call inside `platform.target`)."""
    cfg, setup, stepper = build(cfg)
    place = setup.place
    train = ("train step", setup.step_fn.jitted,
             (abstract(place.abstract_state, place.state), sharded(stepper.batch_spec(), place.batch)))
    return [train, *stepper.programs()]


@contextlib.contextmanager
def _declared_gpu() -> Iterator[None]:
    """JAX's cuDNN attention asks the installed CUDA plugin for cuDNN's version and the
    local GPU's compute capability while it traces; without a plugin (a CPU machine) the
    trace declares `DECLARED_CUDNN` on a `DECLARED_CAPABILITY` GPU instead."""
    if _cudnn_attention.cuda_versions is not None:
        yield
        return
    parse = lambda c: tuple(int(x) for x in c.split("."))  # noqa: E731
    saved = {name: getattr(_cudnn_attention, name) for name in (
        "check_cudnn_version", "check_compute_capability", "is_cuda_compute_capability_equal")}
    _cudnn_attention.check_cudnn_version = lambda: DECLARED_CUDNN
    _cudnn_attention.check_compute_capability = lambda c: DECLARED_CAPABILITY >= parse(c)
    _cudnn_attention.is_cuda_compute_capability_equal = lambda c: DECLARED_CAPABILITY == parse(c)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(_cudnn_attention, name, fn)


def lower(cfg: Config, lowering_platform: str = "cuda") -> list[Lowered]:
    """Every program of the run lowered for `lowering_platform`, traced with that
    platform's choices."""
    with platform.target(BACKENDS[lowering_platform]), _declared_gpu():
        return [Lowered(name, fn.trace(*args).lower(lowering_platforms=(lowering_platform,))
                        .as_text())
                for name, fn, args in programs(cfg)]

"""The platform programs are traced for: JAX's backend, or the one `target` names.

Choices that depend on the hardware (attention `auto`, Pallas's interpreter, the MoE matmul,
`model.dtype=auto`, `model.remat=auto`) ask `backend()` instead of `jax.default_backend()`,
so that a CPU machine can trace and lower a run's programs exactly as a GPU would run them
(`gpurl.train.lowering`, the `cuda_lowering` tests, `gpurl plan plan.target=h100`): with
`target("gpu")` a program is traced with the GPU's choices and lowered with
`lowering_platforms=("cuda",)`.

A targeted GPU has a declared compute capability (Hopper, 9.0, unless `target` names
another): JAX's cuDNN attention asks the local GPU for it while it traces, and there is
no local GPU, so inside `target("gpu")` those questions are answered for the declared one
(and cuDNN's version is the installed library's, or `DECLARED_CUDNN` without one).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

import jax
from jax._src.cudnn import fused_attention_stablehlo as _cudnn_attention

# The GPU a program is traced for when none is named: cuDNN 9.28, what the cuda12 and
# cuda13 extras resolve to (tests/test_install.py), on a Hopper GPU (H100 / H200).
DECLARED_CUDNN = 92800
DECLARED_CAPABILITY = (9, 0)
CUDNN_ATTENTION_CAPABILITY = (8, 0)  # JAX's cuDNN flash attention needs Ampere or newer


@dataclass(frozen=True)
class _Target:
    backend: str
    capability: tuple[int, int]


_TARGET: contextvars.ContextVar[_Target | None] = contextvars.ContextVar("target", default=None)


def backend() -> str:
    """"cpu", "gpu" or "tpu": the targeted backend inside `target`, else JAX's."""
    current = _TARGET.get()
    return current.backend if current else jax.default_backend()


def sampling_compiler_options() -> dict[str, int]:
    """XLA options of the rollout's programs (prefill, decode) on GPU: no dot merging. XLA's
    GPU compiler merges matmuls that share an input (q, k and v; gate and up) into one
    whose weight is their concatenation, so every decode step copies those weights out of
    their stacks before reading them: 3x a decode step's weight traffic, which bounds it
    (`gpurl.plan.account` counts it)."""
    return {"xla_gpu_dot_merger_threshold_mb": 0} if backend() == "gpu" else {}


def cudnn_attention_supported() -> bool:
    """Whether the GPU programs are traced for runs JAX's cuDNN flash attention (compute
    capability 8.0 or newer): the targeted one's declared capability, else the local GPU's."""
    current = _TARGET.get()
    if current is not None:
        return current.capability >= CUDNN_ATTENTION_CAPABILITY
    try:
        return bool(_cudnn_attention.check_compute_capability(
            ".".join(map(str, CUDNN_ATTENTION_CAPABILITY))))
    except Exception:  # noqa: BLE001 - no CUDA backend to ask
        return False


@contextlib.contextmanager
def target(name: str, capability: tuple[int, int] = DECLARED_CAPABILITY) -> Iterator[None]:
    """Builds and traces inside this block make the choices of backend `name` ("gpu"),
    for a GPU of compute `capability`."""
    token = _TARGET.set(_Target(name, capability))
    try:
        with _declared_gpu(capability) if name == "gpu" else contextlib.nullcontext():
            yield
    finally:
        _TARGET.reset(token)


def _cudnn_version() -> int:
    if _cudnn_attention.cuda_versions is None:
        return DECLARED_CUDNN
    try:
        return int(_cudnn_attention.cuda_versions.cudnn_get_version())
    except Exception:  # noqa: BLE001 - a plugin without its cuDNN library
        return DECLARED_CUDNN


@contextlib.contextmanager
def _declared_gpu(capability: tuple[int, int]) -> Iterator[None]:
    """JAX's cuDNN attention, traced inside this block, sees a GPU of `capability`."""
    parse = lambda c: tuple(int(x) for x in c.split("."))  # noqa: E731
    version = _cudnn_version()
    names = ("check_cudnn_version", "check_compute_capability", "is_cuda_compute_capability_equal")
    saved = {name: getattr(_cudnn_attention, name) for name in names}
    _cudnn_attention.check_cudnn_version = lambda: version
    _cudnn_attention.check_compute_capability = lambda c: capability >= parse(c)
    _cudnn_attention.is_cuda_compute_capability_equal = lambda c: capability == parse(c)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(_cudnn_attention, name, fn)

"""The platform programs are traced for: JAX's backend, or the one `target` names.

Choices that depend on the hardware (attention `auto`, Pallas's interpreter, the MoE matmul,
`model.dtype=auto`, `model.remat=auto`) ask `backend()` instead of `jax.default_backend()`,
so that a CPU machine can trace and lower a run's programs exactly as a GPU would run them
(`gpurl.train.lowering`, the `cuda_lowering` tests): with `target("gpu")` a program is
traced with the GPU's choices and lowered with `lowering_platforms=("cuda",)`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("target", default=None)


def backend() -> str:
    """"cpu", "gpu" or "tpu": the targeted backend inside `target`, else JAX's."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def target(name: str) -> Iterator[None]:
    """Builds and traces inside this block make the choices of backend `name` ("gpu")."""
    token = _TARGET.set(name)
    try:
        yield
    finally:
        _TARGET.reset(token)

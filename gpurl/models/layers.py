"""What the decoder's modules share: parameter creation, activations, and how a traced
forward pass learns the layout of its batch and weights on the mesh (`sharded_rows`).

Every parameter carries `logical_axes` metadata; `gpurl.distributed.mesh` maps them to
mesh axes with the rules of the mesh (`mesh.train_rules`, `mesh.sample_rules`).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

ACTIVATIONS = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float,
          dtype: Any) -> nnx.Param:
    value = std * jax.random.normal(rngs.params(), shape, dtype=jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


@dataclass(frozen=True)
class Layout:
    """The batch rows' sharding of a traced program and the rules that placed its
    parameters (None: the program does not say, e.g. a reference test's forward)."""

    rows: NamedSharding
    rules: Mapping[str, Sequence[str]] | None = None


_LAYOUT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("layout", default=None)


@contextlib.contextmanager
def sharded_rows(rows: NamedSharding | None,
                 rules: Mapping[str, Sequence[str]] | None = None) -> Iterator[None]:
    """Forward passes traced inside this block keep their activations' rows (axis 0)
    sharded like `rows` (a batch sharding): without it XLA may all-gather the activations
    instead of the FSDP-sharded weights, which replicates every activation of a step on
    every device of the fsdp axis. With `rules` (how the parameters were placed),
    mixture-of-experts layers route each device's own tokens (`gpurl.models.moe`)."""
    token = _LAYOUT.set(None if rows is None else Layout(rows, rules))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def layout() -> Layout | None:
    return _LAYOUT.get()


def constrain_rows(x: jax.Array) -> jax.Array:
    """`x` (rows first) with its rows sharded as `sharded_rows` says; other axes free."""
    current = _LAYOUT.get()
    if current is None or x.ndim == 0:
        return x
    rows = current.rows
    spec = P(rows.spec[0] if rows.spec else None, *([P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(rows.mesh, spec))

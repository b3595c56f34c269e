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
_SPLIT_TOKENS: contextvars.ContextVar[bool] = contextvars.ContextVar("split_tokens", default=False)

CONTEXT = "context"  # the trainer mesh's axis that packed rows' tokens are split over


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


@contextlib.contextmanager
def split_tokens() -> Iterator[None]:
    """Forward passes traced inside this block run on packed rows whose tokens (axis 1)
    are split over the mesh's context axis (`context_axis`), when it has one: every
    per-token layer stays on its device and attention gathers the keys it needs."""
    token = _SPLIT_TOKENS.set(True)
    try:
        yield
    finally:
        _SPLIT_TOKENS.reset(token)


def context_axis() -> str | None:
    """The mesh axis the traced forward's tokens are split over: `CONTEXT` inside
    `split_tokens` on a mesh where it has more than one device, else None."""
    current = _LAYOUT.get()
    if current is None or not _SPLIT_TOKENS.get():
        return None
    mesh = current.rows.mesh
    return CONTEXT if mesh.shape.get(CONTEXT, 1) > 1 else None


def _row_axes(current: Layout) -> Any:
    spec = current.rows.spec
    return spec[0] if spec else None


def constrain_rows(x: jax.Array) -> jax.Array:
    """`x` (rows first) with its rows sharded as `sharded_rows` says, and its tokens (axis
    1) over the context axis inside `split_tokens`; other axes free."""
    current = _LAYOUT.get()
    if current is None or x.ndim == 0:
        return x
    context = context_axis()
    tokens = [context] if context is not None and x.ndim > 1 else []
    rest = [P.UNCONSTRAINED] * (x.ndim - 1 - len(tokens))
    spec = P(_row_axes(current), *tokens, *rest)
    return jax.lax.with_sharding_constraint(x, NamedSharding(current.rows.mesh, spec))


def constrain_blocks(x: jax.Array) -> jax.Array:
    """`x` whose axis 0 is packed rows x context blocks (each row's C blocks of tokens,
    merged row-major): split over the rows' axes and then the context axis, so each
    device keeps its own blocks (C = 1: `constrain_rows` without the context axis)."""
    current = _LAYOUT.get()
    if current is None:
        return x
    rows = _row_axes(current)
    mesh = current.rows.mesh
    axes = (rows,) if isinstance(rows, str) else tuple(rows or ())
    if mesh.shape.get(CONTEXT, 1) > 1:
        axes += (CONTEXT,)
    spec = P(axes or None, *([P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

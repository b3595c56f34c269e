"""The grouped matmul of a mixture-of-experts layer written with Pallas for GPUs (Triton
lowering): forward, input gradient and weight gradient.

The rows come in `grouped_matmul.TileLayout`: sorted by group and laid out in tiles of
`tile` rows, each group padded to whole tiles, so that every tile belongs to one group
(the layout of vLLM's `moe_align_block_size` and of megablox; the tiles past the used ones
hold nothing). Two kernels:

- `gpurl_grouped_mm`: a program owns one tile and one block of output columns and
  multiplies the tile by its group's weight (or the weight's transpose: the input
  gradient), walking the contracted dimension in blocks. A program past the used tiles
  reads nothing and writes zeros. Each tile reads its own group's weight only: an expert
  no row was routed to is never read, and the tiles of one expert read its weight from L2
  after the first.
- `gpurl_grouped_tmm`: the weight gradient. A program owns one group and one block of
  the weight and sums x_tile^T dy_tile over that group's tiles only (a ragged loop: a
  group of no rows writes zeros).

Work is (routed rows + less than one tile per group) x D x F per matmul, never
E x rows x D x F (what XLA's GPU compiler makes of `jax.lax.ragged_dot`). The kernel's
name carries the rows a balanced routing lays out (`rows<N>`), which is what
`gpurl.plan.account` charges: the real count is only known when it runs.
Dimensions are zero-padded to multiples of 16 (Triton's smallest dot).
`interpret=True` runs the same kernels in Pallas's interpreter on any backend (CI).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gpurl.config import ConfigError

SMALLEST = 16  # Triton's dot: every block dimension at least this


class OffsetLimitError(ConfigError):
    """A call the kernel's 32-bit offsets cannot address. `scale`: the factor its token
    copies must shrink by to fit (None: the expert weights alone are too large), which an
    automatic micro-batch budget applies (`gpurl.train.fitting`)."""

    def __init__(self, message: str, scale: float | None, rows: int = 0):
        super().__init__(message)
        self.scale, self.rows = scale, rows


class Static(NamedTuple):
    """Compile-time settings of one call (hashable for custom_vjp)."""

    tile: int
    groups: int
    balanced_rows: int  # laid-out rows under a balanced routing (the account's charge)
    interpret: bool


def _block(size: int, cap: int) -> int:
    """The largest power of two <= cap dividing `size` (a multiple of SMALLEST)."""
    block = cap
    while size % block:
        block //= 2
    return block


def _params(tile: int, cols: int) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=8 if tile * cols >= 128 * 64 else 4, num_stages=2)


def _aligned(*operands: jax.Array) -> tuple[jax.Array, ...]:
    """The operands, each varying over the mesh axes any of them varies over inside a
    `shard_map` (Pallas's calls take operands of one kind)."""
    mats = [jax.typeof(o).mat for o in operands]
    union = frozenset().union(*(m.varying for m in mats))
    return tuple(o if m.varying == union else
                 jax.lax.pcast(o, tuple(sorted(union - m.varying)), to="varying")
                 for o, m in zip(operands, mats))


def _out(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """The output's shape and type, varying over the mesh axes `like` varies over."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def _mm_kernel(used_ref, group_ref, x_ref, w_ref, o_ref, *, tile: int, bn: int, bk: int,
               depth: int, transpose: bool):
    i, j = pl.program_id(0), pl.program_id(1)
    g = group_ref[i]
    rows = pl.ds(i * tile, tile)

    def step(kk, acc):
        xb = x_ref[rows, pl.ds(kk * bk, bk)]
        if transpose:  # w is groups*N x K: this group's N rows, a block of them
            wb = w_ref[pl.ds(g * o_ref.shape[1] + j * bn, bn), pl.ds(kk * bk, bk)]
            return acc + plgpu.dot(xb, wb, trans_b=True, allow_tf32=False)
        wb = w_ref[pl.ds(g * depth + kk * bk, bk), pl.ds(j * bn, bn)]  # w is groups*K x N
        return acc + plgpu.dot(xb, wb, allow_tf32=False)

    # past the used tiles: nothing read
    steps = jnp.where(i < used_ref[0], jnp.int32(depth // bk), jnp.int32(0))
    acc = jax.lax.fori_loop(jnp.int32(0), steps, step, jnp.zeros((tile, bn), jnp.float32))
    o_ref[rows, pl.ds(j * bn, bn)] = acc.astype(o_ref.dtype)


def _tmm_kernel(first_ref, count_ref, x_ref, dy_ref, o_ref, *, tile: int, bd: int, bf: int,
                depth: int):
    g, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first = first_ref[g]

    def step(t, acc):
        rows = pl.ds((first + t) * tile, tile)
        xb, yb = x_ref[rows, pl.ds(a * bd, bd)], dy_ref[rows, pl.ds(b * bf, bf)]
        return acc + plgpu.dot(xb, yb, trans_a=True, allow_tf32=False)

    acc = jax.lax.fori_loop(jnp.int32(0), count_ref[g], step, jnp.zeros((bd, bf), jnp.float32))
    o_ref[pl.ds(g * depth + a * bd, bd), pl.ds(b * bf, bf)] = acc.astype(o_ref.dtype)


def _mm(x, w2, used, tile_group, st: Static, transpose: bool):
    """x (tiles*tile x K) times each tile's group's weight: w2 is groups*K x N (or
    groups*N x K with `transpose`)."""
    used, tile_group, x, w2 = _aligned(used, tile_group, x, w2)
    size, depth = x.shape
    cols = w2.shape[0] // st.groups if transpose else w2.shape[1]
    bn, bk = _block(cols, 128), _block(depth, 64)
    kernel = functools.partial(_mm_kernel, tile=st.tile, bn=bn, bk=bk, depth=depth,
                               transpose=transpose)
    return pl.pallas_call(
        kernel, grid=(size // st.tile, cols // bn), interpret=st.interpret,
        name=f"gpurl_grouped_mm_rows{st.balanced_rows}", compiler_params=_params(st.tile, bn),
        out_shape=_out((size, cols), x.dtype, x),
    )(used, tile_group, x, w2)


def _tmm(x, dy, first, count, st: Static):
    """groups*K x N: each group's sum of x_tile^T dy_tile over its tiles."""
    first, count, x, dy = _aligned(first, count, x, dy)
    depth, cols = x.shape[1], dy.shape[1]
    bd, bf = _block(depth, 64), _block(cols, 64)
    kernel = functools.partial(_tmm_kernel, tile=st.tile, bd=bd, bf=bf, depth=depth)
    return pl.pallas_call(
        kernel, grid=(st.groups, depth // bd, cols // bf), interpret=st.interpret,
        name=f"gpurl_grouped_tmm_rows{st.balanced_rows}", compiler_params=_params(bd, bf),
        out_shape=_out((st.groups * depth, cols), x.dtype, x),
    )(first, count, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _grouped(x, w, used, tile_group, first, count, st: Static):
    g, depth, cols = w.shape
    return _mm(x, w.reshape(g * depth, cols), used, tile_group, st, transpose=False)


def _grouped_fwd(x, w, used, tile_group, first, count, st: Static):
    return _grouped(x, w, used, tile_group, first, count, st), (x, w, used, tile_group, first, count)


def _grouped_bwd(st: Static, res, dy):
    x, w, used, tile_group, first, count = res
    g, depth, cols = w.shape
    dx = _mm(dy, w.reshape(g * depth, cols), used, tile_group, st, transpose=True)
    dw = _tmm(x, dy, first, count, st).reshape(g, depth, cols).astype(w.dtype)
    return dx, dw, None, None, None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _pad_to(x: jax.Array, axis: int) -> jax.Array:
    extra = -x.shape[axis] % SMALLEST
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def tiled_matmul(x_pad: jax.Array, w_OxDxF: jax.Array, layout, balanced_rows: int | None = None,
                 interpret: bool = False) -> jax.Array:
    """`grouped_matmul.tiled_matmul` as Pallas kernels: (tiles x tile) x F, each tile of the
    laid-out rows `x_pad` times its group's weight, zeros past the used tiles.
    Differentiable in `x_pad` and `w_OxDxF`. `balanced_rows`: the rows a balanced routing
    lays out (what the compiler's account charges; all the tiles unless given)."""
    g, d, f = w_OxDxF.shape
    if layout.tile % SMALLEST:
        raise ValueError(f"the Pallas grouped matmul needs tiles of a multiple of {SMALLEST} rows, "
                         f"not {layout.tile}")
    weights = g * (d + SMALLEST) * (f + SMALLEST)
    if max(x_pad.shape[0] * (d + SMALLEST), weights) >= 2**31:
        raise OffsetLimitError(
            f"the Pallas grouped matmul addresses its operands with 32-bit offsets, and "
            f"{x_pad.shape[0]:,} token copies x {d} or {g} experts x {d} x {f} do not fit them; "
            f"use smaller micro-batches (train.micro_batch_tokens) or model.moe.grouped_matmul=ragged.",
            None if weights >= 2**31 else (2**31 - 1) // (d + SMALLEST) / x_pad.shape[0],
            x_pad.shape[0])
    st = Static(layout.tile, g, int(balanced_rows if balanced_rows is not None else x_pad.shape[0]),
                interpret)
    x = _pad_to(x_pad, 1)
    w = _pad_to(_pad_to(w_OxDxF.astype(x.dtype), 1), 2)
    out = _grouped(x, w, jnp.reshape(layout.used, (1,)).astype(jnp.int32),
                   layout.tile_group.astype(jnp.int32), layout.group_first.astype(jnp.int32),
                   layout.group_tiles.astype(jnp.int32), st)
    return out[:, :f]

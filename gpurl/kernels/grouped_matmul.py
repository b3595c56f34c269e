"""Grouped matmul of a mixture-of-experts layer: rows sorted by expert, each group of rows
times its expert's weight, `jax.lax.ragged_dot`'s contract.

    out[r] = x[r] @ w[g]  for the rows r of group g (groups are consecutive row ranges of
    sizes_O, in order); rows past sum(sizes_O) are zero.

Two implementations:

- `ragged`: `jax.lax.ragged_dot`. On CPU XLA expands it to G dense matmuls over all rows
  with masks (measured: 36x one dense matmul's time for 16 groups), so it is not used
  there by default. XLA's GPU compiler (jax 0.10.2) expands it the same way, E x the
  useful flops, yet by the compiler's account (`gpurl plan plan.target=h100`,
  docs/scaling.md) it is still the faster of the two on GPU: `qwen3_30b_a3b` (128
  experts) decodes in 8.0 ms per step at the roofline (bandwidth-bound: the weights once)
  against the tiled version's 28.6 ms, which reads an expert's weights once per tile.
- `tiled` (the jnp reference, default on CPU): the rows are laid out in tiles of `tile`
  rows, each group padded to whole tiles so that every tile belongs to one group; a
  `lax.map` over the tiles multiplies each by its group's weight. Work is
  (rows + O x tile) x D x F, never O x rows x D x F (the megablox scheme without a kernel;
  an expert-parallel device's rows include its group's copies for other devices' experts,
  which `model.moe.capacity_factor` bounds).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gpurl.kernels import platform


def resolve(implementation: str) -> str:
    """`auto`: ragged on accelerators, tiled on CPU."""
    if implementation == "auto":
        return "tiled" if platform.backend() == "cpu" else "ragged"
    return implementation


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: the power of two near the mean group size, within [8, 128]."""
    mean = max(rows // max(groups, 1), 1)
    return int(min(max(1 << (mean.bit_length() - 1), 8), 128))


class TileLayout(NamedTuple):
    """Where sorted rows go in the tiled layout: `tiles` tiles of `tile` rows, each group
    padded to whole tiles."""

    slot: jax.Array  # per sorted row: its row in the layout (tiles x tile: past the groups)
    tile_group: jax.Array  # per tile: its group (trailing tiles: the last group)
    tile: int
    tiles: int


def tile_layout(rows: int, sizes_O: jax.Array) -> TileLayout:
    """The layout of `rows` sorted rows in groups of sizes `sizes_O` (their sum <= rows)."""
    g = sizes_O.shape[0]
    tile = tile_rows(rows, g)
    tiles = -(-rows // tile) + g  # every group wastes less than one tile
    sizes_O = sizes_O.astype(jnp.int32)
    padded_O = (sizes_O + tile - 1) // tile * tile
    start_O = jnp.cumsum(sizes_O) - sizes_O  # first row of each group
    padded_start_O = jnp.cumsum(padded_O) - padded_O  # ... in the tiled layout
    row = jnp.arange(rows, dtype=jnp.int32)
    group_of_row = jnp.searchsorted(jnp.cumsum(sizes_O), row, side="right").astype(jnp.int32)
    in_group = group_of_row < g
    group_of_row = jnp.minimum(group_of_row, g - 1)
    slot = padded_start_O[group_of_row] + row - start_O[group_of_row]
    slot = jnp.where(in_group, slot, tiles * tile)
    tile_group = jnp.searchsorted(jnp.cumsum(padded_O), jnp.arange(tiles) * tile, side="right")
    return TileLayout(slot, jnp.minimum(tile_group, g - 1).astype(jnp.int32), tile, tiles)


def tiled_matmul(x_pad: jax.Array, w_OxDxF: jax.Array, layout: TileLayout) -> jax.Array:
    """(tiles x tile) x F: each tile of the laid-out rows `x_pad` times its group's weight
    (tiles past the groups hold zero rows)."""
    tile, f = layout.tile, w_OxDxF.shape[2]

    # Rematerialized: the backward pass re-slices each tile's weight instead of keeping
    # one D x F copy per tile (tiles x D x F, more than all experts' weights).
    # Unused tiles are multiplied too: skipping them with `lax.cond` inside the map
    # corrupted the heap of XLA's CPU runtime under shard_map (jax 0.10, reproducible).
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one(args):
        tile_x, group = args
        w = jax.lax.dynamic_index_in_dim(w_OxDxF, group, keepdims=False)
        return tile_x @ w.astype(tile_x.dtype)

    out = jax.lax.map(one, (x_pad.reshape(layout.tiles, tile, -1), layout.tile_group))
    return out.reshape(layout.tiles * tile, f)


def _tiled(rows_x: jax.Array, w_OxDxF: jax.Array, sizes_O: jax.Array) -> jax.Array:
    m = rows_x.shape[0]
    layout = tile_layout(m, sizes_O)
    size = layout.tiles * layout.tile
    x_pad = jnp.zeros((size, rows_x.shape[1]), rows_x.dtype).at[layout.slot].set(rows_x, mode="drop")
    out = tiled_matmul(x_pad, w_OxDxF, layout)
    return jnp.where((layout.slot < size)[:, None], out[jnp.minimum(layout.slot, size - 1)], 0)


def grouped_matmul(rows_x: jax.Array, w_OxDxF: jax.Array, sizes_O: jax.Array,
                   implementation: str = "auto") -> jax.Array:
    """rows x F: each group of consecutive rows of `rows_x` (rows x D; sizes `sizes_O`)
    times its expert's weight; rows past the groups are zero. Differentiable in `rows_x`
    and `w_OxDxF`."""
    implementation = resolve(implementation)
    if implementation == "ragged":
        return jax.lax.ragged_dot(rows_x, w_OxDxF.astype(rows_x.dtype), sizes_O.astype(jnp.int32))
    return _tiled(rows_x, w_OxDxF, sizes_O)

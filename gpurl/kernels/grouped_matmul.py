"""Grouped matmul of a mixture-of-experts layer: rows sorted by expert, each group of rows
times its expert's weight, `jax.lax.ragged_dot`'s contract.

    out[r] = x[r] @ w[g]  for the rows r of group g (groups are consecutive row ranges of
    sizes_O, in order); rows past sum(sizes_O) are zero.

Three implementations (`model.moe.grouped_matmul`):

- `pallas` (default on GPU): Pallas kernels compiled by Triton (`gpurl.kernels.pallas_grouped`)
  on the tiled layout below: each tile reads its group's weight and multiplies only the
  routed rows (plus less than a tile per group), forward and both gradients.
- `ragged`: `jax.lax.ragged_dot` (default on TPU, where XLA lowers it as a grouped matmul;
  not checked here). XLA's
  GPU compiler in jax 0.10.2 expands it into a matmul of every row with every expert, E x
  the useful flops (its cuDNN ragged-dot fusion, `xla_gpu_experimental_use_ragged_dot_fusion`,
  emits nothing different for compile-only H100s: checked with `gpurl plan`), and XLA's
  CPU compiler into G masked dense matmuls (36x one dense matmul's time for 16 groups).
- `tiled` (the jnp reference, default on CPU): the rows are laid out in tiles of `tile`
  rows, each group padded to whole tiles so that every tile belongs to one group; a
  `lax.map` over the tiles multiplies each by its group's weight. Work is
  (rows + O x tile) x D x F, never O x rows x D x F (the megablox scheme without a kernel;
  an expert-parallel device's rows include its group's copies for other devices' experts,
  which `model.moe.capacity_factor` bounds), but every tile copies its group's weight out
  of the stack (the compiler's account: 5.8x the decode step's ideal bytes for
  `qwen3_30b_a3b`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gpurl.kernels import pallas_grouped, platform

AUTO = {"cpu": "tiled", "gpu": "pallas", "tpu": "ragged"}


def resolve(implementation: str) -> str:
    """`auto`: the Pallas kernels on GPU, ragged_dot on TPU, the jnp tiles on CPU."""
    if implementation == "auto":
        return AUTO.get(platform.backend(), "tiled")
    return implementation


def smallest_tile(implementation: str) -> int:
    """The fewest rows per tile `implementation` takes (Triton's dot: 16)."""
    return pallas_grouped.SMALLEST if resolve(implementation) == "pallas" else 8


def layout_matmul(x_pad: jax.Array, w_OxDxF: jax.Array, layout: "TileLayout", implementation: str,
                  balanced_rows: int | None = None) -> jax.Array:
    """(tiles x tile) x F: each tile of the laid-out rows times its group's weight, by the
    jnp reference (`tiled`) or the Pallas kernels (`pallas`, in Pallas's interpreter off
    GPU). `balanced_rows`: the rows a balanced routing lays out (the account's charge)."""
    if resolve(implementation) == "pallas":
        return pallas_grouped.tiled_matmul(x_pad, w_OxDxF, layout, balanced_rows,
                                           interpret=platform.backend() != "gpu")
    return tiled_matmul(x_pad, w_OxDxF, layout)


def tile_rows(rows: int, groups: int, smallest: int = 8) -> int:
    """Rows per tile: the power of two near the mean group size, within [smallest, 128]."""
    mean = max(rows // max(groups, 1), 1)
    return int(min(max(1 << (mean.bit_length() - 1), smallest), 128))


class TileLayout(NamedTuple):
    """Where sorted rows go in the tiled layout: `tiles` tiles of `tile` rows, each group
    padded to whole tiles."""

    slot: jax.Array  # per sorted row: its row in the layout (tiles x tile: past the groups)
    tile_group: jax.Array  # per tile: its group (trailing tiles: the last group)
    tile: int
    tiles: int
    used: jax.Array  # tiles that hold a group's rows (the first ones)
    group_first: jax.Array  # per group: its first tile
    group_tiles: jax.Array  # per group: its tiles (0: an empty group)


def tile_layout(rows: int, sizes_O: jax.Array, smallest: int = 8) -> TileLayout:
    """The layout of `rows` sorted rows in groups of sizes `sizes_O` (their sum <= rows),
    in tiles of at least `smallest` rows."""
    g = sizes_O.shape[0]
    tile = tile_rows(rows, g, smallest)
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
    return TileLayout(slot, jnp.minimum(tile_group, g - 1).astype(jnp.int32), tile, tiles,
                      padded_O.sum() // tile, padded_start_O // tile, padded_O // tile)


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


def _tiled(rows_x: jax.Array, w_OxDxF: jax.Array, sizes_O: jax.Array, implementation: str
           ) -> jax.Array:
    m = rows_x.shape[0]
    layout = tile_layout(m, sizes_O, smallest_tile(implementation))
    size = layout.tiles * layout.tile
    x_pad = jnp.zeros((size, rows_x.shape[1]), rows_x.dtype).at[layout.slot].set(rows_x, mode="drop")
    out = layout_matmul(x_pad, w_OxDxF, layout, implementation)
    return jnp.where((layout.slot < size)[:, None], out[jnp.minimum(layout.slot, size - 1)], 0)


def grouped_matmul(rows_x: jax.Array, w_OxDxF: jax.Array, sizes_O: jax.Array,
                   implementation: str = "auto") -> jax.Array:
    """rows x F: each group of consecutive rows of `rows_x` (rows x D; sizes `sizes_O`)
    times its expert's weight; rows past the groups are zero. Differentiable in `rows_x`
    and `w_OxDxF`."""
    implementation = resolve(implementation)
    if implementation == "ragged":
        return jax.lax.ragged_dot(rows_x, w_OxDxF.astype(rows_x.dtype), sizes_O.astype(jnp.int32))
    return _tiled(rows_x, w_OxDxF, sizes_O, implementation)

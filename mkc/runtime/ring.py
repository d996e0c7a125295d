"""Ring streaming of weight tiles: every streamed matrix of a decode step, in consumption order,
flows HBM -> VMEM through one ring of slots, a fixed number of tiles ahead of the MXU.

The HBM side is ``hbm [total_tiles, slot_rows, slot_cols]``: tile t of the step, zero padded.
Tile t lands in slot ``t % slots`` and is copied as its family's ``[tile_rows, tile_cols]``
sub-block (families pick their own tile, a slot holds the largest). When a tile is consumed,
tile ``t + ahead`` is started; its shape comes from an SMEM table of tile classes, as it may
belong to a later family or layer than the one computing. A family's tiles run column blocks
outer, rows inner, so a column block's f32 partial products accumulate row tile by row tile.

`mkc.trace` models exactly this order; the checks prove the slot reuse safe.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc.runtime import scopes

F32 = jnp.float32
BF16 = jnp.bfloat16


@dataclass(frozen=True)
class StreamedMatrix:
    """One streamed matrix family's tiling (per rank)."""

    name: str
    rows: int
    cols: int
    row_tiles: int
    col_tiles: int
    tile_rows: int
    tile_cols: int

    @property
    def tiles(self) -> int:
        return self.row_tiles * self.col_tiles


@dataclass(frozen=True)
class Ring:
    """The ring's geometry: slots, how far ahead tiles are issued, the step's tile count and the
    distinct tile shapes (classes) in use."""

    slots: int
    ahead: int
    total_tiles: int
    tile_shapes: tuple[tuple[int, int], ...]

    @property
    def slot_shape(self) -> tuple[int, int]:
        return max(r for r, _ in self.tile_shapes), max(c for _, c in self.tile_shapes)


@dataclass(frozen=True)
class RingRefs:
    """The refs a ring works on: HBM tiles, VMEM slots and their DMA semaphores, the SMEM
    tile-class table, and the VMEM staging (bf16 activation row blocks) and f32 accumulator."""

    hbm: object
    slots: object
    sems: object
    tile_class: object
    stage: object
    acc: object


def _copy(ring: Ring, refs: RingRefs, t, slot, rows: int, cols: int):
    return pltpu.make_async_copy(refs.hbm.at[t, :rows, :cols], refs.slots.at[slot, :rows, :cols],
                                 refs.sems.at[slot])


def start_tile(ring: Ring, refs: RingRefs, t) -> None:
    """Issue tile t into slot t % slots, with the shape its tile class gives."""
    slot = lax.rem(t, ring.slots)
    if len(ring.tile_shapes) == 1:
        _copy(ring, refs, t, slot, *ring.tile_shapes[0]).start()
        return
    cls = refs.tile_class[t]
    for c, (rows, cols) in enumerate(ring.tile_shapes):
        @pl.when(cls == c)
        def _():
            _copy(ring, refs, t, slot, rows, cols).start()


def fill(ring: Ring, refs: RingRefs) -> None:
    """The prologue: the first `ahead` tiles of the step."""
    for t in range(min(ring.ahead, ring.total_tiles)):
        start_tile(ring, refs, t)


def matmul(ring: Ring, refs: RingRefs, h: jax.Array, first_tile, m: StreamedMatrix) -> jax.Array:
    """h [B, rows] @ matrix m, whose tiles are ring tiles first_tile.. -> [B, col_tiles *
    tile_cols] f32 (columns past m.cols are the zero padding). Each consumed tile starts the tile
    `ahead` after it."""
    tr, tc = m.tile_rows, m.tile_cols
    for i in range(m.row_tiles):
        width = min(tr, h.shape[1] - i * tr)
        if width == tr:
            refs.stage[i, :, :tr] = h[:, i * tr:(i + 1) * tr].astype(BF16)
        else:
            refs.stage[i, :, :tr] = jnp.zeros((h.shape[0], tr), BF16)
            refs.stage[i, :, :width] = h[:, i * tr:].astype(BF16)

    def tile(k, carry):
        t = first_tile + k
        slot = lax.rem(t, ring.slots)
        i, j = lax.rem(k, m.row_tiles), k // m.row_tiles
        _copy(ring, refs, t, slot, tr, tc).wait()
        with scopes.weights():
            part = jnp.dot(refs.stage[i, :, :tr], refs.slots[slot, :tr, :tc], preferred_element_type=F32)

            @pl.when(i == 0)
            def _():
                refs.acc[j, :, :tc] = part

            @pl.when(i != 0)
            def _():
                refs.acc[j, :, :tc] = refs.acc[j, :, :tc] + part

        @pl.when(t + ring.ahead < ring.total_tiles)
        def _():
            start_tile(ring, refs, t + ring.ahead)
        return carry

    lax.fori_loop(0, m.tiles, tile, 0)
    if m.col_tiles == 1:
        return refs.acc[0, :, :tc]
    return jnp.concatenate([refs.acc[j, :, :tc] for j in range(m.col_tiles)], axis=-1)


# ---- host side: packing a step's matrices into the ring's HBM layout --------------------------
def tile_classes(ring: Ring, sequence: list[StreamedMatrix]) -> np.ndarray:
    """The tile class of every tile of the step (an SMEM table), from the matrices in stream
    order."""
    classes: list[int] = []
    for m in sequence:
        classes += [ring.tile_shapes.index((m.tile_rows, m.tile_cols))] * m.tiles
    return np.array(classes, np.int32)


def put_tiles(hbm: np.ndarray, first_tile: int, matrix: np.ndarray, m: StreamedMatrix) -> int:
    """Cut `matrix` into m's tiles and store them from tile first_tile on, in stream order
    (column blocks outer, rows inner), zero padded; returns the next tile."""
    tr, tc = m.tile_rows, m.tile_cols
    padded = np.zeros((m.row_tiles * tr, m.col_tiles * tc), np.float32)
    padded[:matrix.shape[0], :matrix.shape[1]] = matrix
    t = first_tile
    for j in range(m.col_tiles):
        for i in range(m.row_tiles):
            hbm[t, :tr, :tc] = padded[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc]
            t += 1
    return t

"""Ring streaming of weight tiles: every streamed matrix of a decode step, in consumption order,
flows HBM -> VMEM through one ring of slots, a fixed number of tiles ahead of the MXU.

The HBM side is ``hbm [total_tiles, slot_rows, slot_cols]``: tile t of the step, zero padded.
Tile t lands in slot ``t % slots`` and is copied as its family's ``[tile_rows, tile_cols]``
sub-block (families pick their own tile, a slot holds the largest). When a tile is consumed,
tile ``t + ahead`` is started; its shape comes from an SMEM table of tile classes, as it may
belong to a later family or layer than the one computing. A family's tiles run column blocks
outer, rows inner, so a column block's f32 partial products accumulate row tile by row tile.

A family stored as 8-bit codes (`format CLASS fp8|int8 channel rounded`,
`mkc.layers.dense_formats`) holds two input rows a slot row (`pltpu.bitcast` unpacks them, as
for a pool's uint8 matrices), and its column blocks' last row tiles carry the block's scales
in `mkc.ir.SCALE_ROWS` more rows (`mkc.ir.ring_tile_shape`): a tile class of their own. The
codes reach the MXU in mixed dots of 256 columns (the last reading on past the tile's columns
in its slot, which is that wide), and the scale multiplies the column block's f32 sum.

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

from mkc import ir
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
    tile_rows: int               # input rows of a tile
    tile_cols: int
    codes: str = "bf16"          # "bf16" values, or "fp8" / "int8" codes with column scales
    fp8_operand: bool = True     # FP8 codes fed to the MXU as they are (else converted first)
    format_class: str = ""       # the dense class stored as codes (its error is reported by it)

    @property
    def tiles(self) -> int:
        return self.row_tiles * self.col_tiles

    def slot_shape(self, last: bool = False) -> tuple[int, int]:
        """The slot rows and columns one of its tiles takes (`last`: a column block's last
        row tile, with the scale rows of codes)."""
        return ir.ring_tile_shape(self.tile_rows, self.tile_cols, self.codes, last)

    def tile_shape(self, k: int) -> tuple[int, int]:
        """The slot shape of tile k of its run (column blocks outer, row tiles inner)."""
        return self.slot_shape(k % self.row_tiles == self.row_tiles - 1)


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


def start_after(ring: Ring, refs: RingRefs, first_tile, tiles: int) -> None:
    """The refills held back for the layer's first `tiles` tiles, from tile first_tile on: each
    tile `ahead` after one of `mkc.ir.held_refills` (`refill`, `mkc.ir.RingRefill`)."""
    for k in ir.held_refills(tiles, ring.ahead):
        t = first_tile + k + ring.ahead

        @pl.when(t < ring.total_tiles)
        def _():
            start_tile(ring, refs, t)


def matmul(ring: Ring, refs: RingRefs, h: jax.Array, first_tile, m: StreamedMatrix,
           refills: int | None = None) -> jax.Array:
    """h [B, rows] @ matrix m, whose tiles are ring tiles first_tile.. -> [B, col_tiles *
    tile_cols] f32 (columns past m.cols are the zero padding). Each of its first `refills`
    tiles (None: all) starts the tile `ahead` after it as it is consumed; the others' refills
    are held back (`start_after`)."""
    if m.codes != "bf16":
        return _codes_matmul(ring, refs, h, first_tile, m, refills)
    tr, tc = m.tile_rows, m.tile_cols
    _stage(refs, h, m)

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

        _refill(ring, refs, t, k, refills, m.tiles)
        return carry

    lax.fori_loop(0, m.tiles, tile, 0)
    return _columns(refs, m)


def _refill(ring: Ring, refs: RingRefs, t, k, refills: int | None, tiles: int) -> None:
    """Tile t (the run's k-th of `tiles`) consumed: start tile t + ahead, unless the run's
    refills from its `refills`-th tile on are held back."""
    if refills is None or refills >= tiles:
        go = t + ring.ahead < ring.total_tiles
    elif refills <= 0:
        return
    else:
        go = (t + ring.ahead < ring.total_tiles) & (k < refills)

    @pl.when(go)
    def _():
        start_tile(ring, refs, t + ring.ahead)


def _columns(refs: RingRefs, m: StreamedMatrix) -> jax.Array:
    tc = m.tile_cols
    if m.col_tiles == 1:
        return refs.acc[0, :, :tc]
    return jnp.concatenate([refs.acc[j, :, :tc] for j in range(m.col_tiles)], axis=-1)


def _stage(refs: RingRefs, h: jax.Array, m: StreamedMatrix) -> None:
    """h's row tiles as bf16, zero padded past its rows, one block a row tile."""
    tr = m.tile_rows
    for i in range(m.row_tiles):
        width = min(tr, h.shape[1] - i * tr)
        if width == tr:
            refs.stage[i, :, :tr] = h[:, i * tr:(i + 1) * tr].astype(BF16)
        else:
            refs.stage[i, :, :tr] = jnp.zeros((h.shape[0], tr), BF16)
            refs.stage[i, :, :width] = h[:, i * tr:].astype(BF16)


def codes_dot(x: jax.Array, packed: jax.Array, codes: str, fp8_operand: bool = True) -> jax.Array:
    """x [B, R] bf16 @ 8-bit codes packed two rows a bf16 element (packed bf16 [R/2, C], rows
    2a and 2a + 1 the low and high bytes of row a, `mkc.runtime.pool`'s pairing) -> f32 [B, C]:
    mixed dots of the codes as they are, `mkc.ir.CODE_DOT_COLUMNS` columns each. FP8: e4m3
    codes where the MXU takes FP8 operands, else converted to bf16 first (exact); int8: a bf16
    x int8 dot (libtpu converts the codes: measured with benchmarks/format_probe.py --dense, no
    dearer than converting them here, and cheaper on v5e). In interpret mode XLA's CPU
    multiplies both operands as f32, which the reference's emulation follows
    (`mkc.reference.rounding.code_linear`, operands "mixed_fp8" and "mixed_int8")."""
    def codes_of(columns: jax.Array) -> jax.Array:
        if codes == "int8":
            return pltpu.bitcast(columns, jnp.int8)
        w = lax.bitcast_convert_type(pltpu.bitcast(columns, jnp.uint8), jnp.float8_e4m3fn)
        return w if fp8_operand else w.astype(BF16)
    n = ir.CODE_DOT_COLUMNS
    parts = [jnp.dot(x, codes_of(packed[:, c:c + n]), preferred_element_type=F32)
             for c in range(0, packed.shape[1], n)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _codes_matmul(ring: Ring, refs: RingRefs, h: jax.Array, first_tile, m: StreamedMatrix,
                  refills: int | None = None) -> jax.Array:
    """`matmul` of a matrix stored as 8-bit codes: each tile's codes in a mixed dot
    (`codes_dot`), the column block's sum times its scales, which its last row tile carries
    after its codes (bf16 values in the first of the scale rows)."""
    _stage(refs, h, m)
    tr, tc = m.tile_rows, m.tile_cols
    rows, last_rows = m.slot_shape()[0], m.slot_shape(last=True)[0]
    read = ir.code_read_cols(tc)           # whole dots: the last reads on past the tile

    def tile(k, carry):
        t = first_tile + k
        slot = lax.rem(t, ring.slots)
        i, j = lax.rem(k, m.row_tiles), k // m.row_tiles
        last = i == m.row_tiles - 1
        if m.row_tiles == 1:
            _copy(ring, refs, t, slot, last_rows, tc).wait()
        else:
            pl.when(last)(lambda: _copy(ring, refs, t, slot, last_rows, tc).wait())
            pl.when(~last)(lambda: _copy(ring, refs, t, slot, rows, tc).wait())
        with scopes.weights():
            part = codes_dot(refs.stage[i, :, :tr], refs.slots[slot, :rows, :read], m.codes,
                             m.fp8_operand)[:, :tc]

            @pl.when(last)
            def _():
                scale = refs.slots[slot, rows:rows + 1, :tc].astype(F32)
                if m.row_tiles == 1:
                    refs.acc[j, :, :tc] = part * scale
                else:
                    refs.acc[j, :, :tc] = (refs.acc[j, :, :tc] + part) * scale

            if m.row_tiles > 1:
                @pl.when(i == 0)
                def _():
                    refs.acc[j, :, :tc] = part

                @pl.when((i != 0) & ~last)
                def _():
                    refs.acc[j, :, :tc] = refs.acc[j, :, :tc] + part

        _refill(ring, refs, t, k, refills, m.tiles)
        return carry

    lax.fori_loop(0, m.tiles, tile, 0)
    return _columns(refs, m)


# ---- host side: packing a step's matrices into the ring's HBM layout --------------------------
def tile_classes(ring: Ring, sequence: list[StreamedMatrix]) -> np.ndarray:
    """The tile class of every tile of the step (an SMEM table), from the matrices in stream
    order."""
    classes: list[int] = []
    for m in sequence:
        classes += [ring.tile_shapes.index(m.tile_shape(k)) for k in range(m.tiles)]
    return np.array(classes, np.int32)


def put_tiles(hbm: np.ndarray, first_tile: int, matrix: np.ndarray, m: StreamedMatrix,
              scales: np.ndarray | None = None) -> int:
    """Cut `matrix` into m's tiles and store them from tile first_tile on, in stream order
    (column blocks outer, rows inner), zero padded; returns the next tile. A matrix of 8-bit
    codes (m.codes: `matrix` uint8, the codes' bytes) is stored two rows a slot row, and its
    per-column `scales` (bf16 values) after each column block's last row tile."""
    tr, tc = m.tile_rows, m.tile_cols
    if m.codes != "bf16":
        return _put_code_tiles(hbm, first_tile, matrix, scales, m)
    padded = np.zeros((m.row_tiles * tr, m.col_tiles * tc), np.float32)
    padded[:matrix.shape[0], :matrix.shape[1]] = matrix
    t = first_tile
    for j in range(m.col_tiles):
        for i in range(m.row_tiles):
            hbm[t, :tr, :tc] = padded[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc]
            t += 1
    return t


def _put_code_tiles(hbm: np.ndarray, first_tile: int, codes: np.ndarray, scales: np.ndarray,
                    m: StreamedMatrix) -> int:
    from mkc.runtime.pool import pair_bytes_as_bf16
    tr, tc = m.tile_rows, m.tile_cols
    rows = m.slot_shape()[0]
    padded = np.zeros((m.row_tiles * tr, m.col_tiles * tc), np.uint8)
    padded[:codes.shape[0], :codes.shape[1]] = codes
    scale_row = np.zeros((m.col_tiles * tc,), np.float32)
    scale_row[:scales.shape[0]] = scales
    t = first_tile
    for j in range(m.col_tiles):
        for i in range(m.row_tiles):
            hbm[t, :rows, :tc] = pair_bytes_as_bf16(padded[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc])
            if i == m.row_tiles - 1:
                hbm[t, rows, :tc] = scale_row[j * tc:(j + 1) * tc]
            t += 1
    return t

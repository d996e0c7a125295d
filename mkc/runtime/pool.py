"""Whole matrices in a VMEM pool: the layout, the host packing and the in-kernel accessors.

A pool is one ``pltpu.VMEM((pool_rows, 128), bfloat16)`` scratch time-shared by views
(``mkc.ir.Pool``). A pooled matrix [rows, cols] starts at a bf16 row offset (its byte offset
// 256) and is stored as ``ceil(cols / 128)`` column panels of 128 lanes, one after the other:

* panel p holds columns [128 p, 128 p + 128) in ``panel_rows(rows, dtype)`` pool rows
  starting at ``row_offset + p * panel_rows``; the last panel's lanes past ``cols`` and each
  panel's rows past the data are padding, never read;
* bf16 data is one matrix row per pool row; uint8 data (MXFP4 codes and scales) packs two
  rows per bf16 element, row 2a in the low byte and row 2a + 1 in the high byte of pool row a,
  which is how ``pltpu.bitcast(value, uint8)`` unpacks [n, 128] bf16 into [2n, 128] uint8;
* ``panel_rows`` rounds up to whole (16, 128) bf16 tiles so every panel starts tile aligned.

Bytes per matrix are ``pooled_rows * 256``, equal to ``mkc.resolve.pools.pooled_bytes``
(the geometry lives in ``mkc.ir``, which the checks read).

A DMA cannot change dtype (uint8 HBM -> bf16 VMEM is rejected) and cannot transpose, so the
HBM form (``pack_for_pool``) is the natural [rows, cols] layout in pool rows: bf16 as is,
uint8 packed in pairs of rows, padded to whole panels. ``start_pooled_copy`` moves it with
one strided DMA per column panel; ``wait_pooled_copy`` waits for all of them at once. Matrices
always fetched together (a routed expert's) are instead packed as they sit in the pool
(``pack_rows``: the panels one after another), so one contiguous DMA moves them all.

A routed expert's block scales (a few rows over many panels) are stored stacked instead
(``pack_stacked``, ``pooled_stacked``, ``mkc.ir.stacked_rows``): the panels' rows one under
another with no tile padding between panels, read whole from the tiles covering each panel.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc import ir
from mkc.runtime import scopes

F32 = jnp.float32
BF16 = jnp.bfloat16
LANES = ir.LANES
TILE_ROWS = ir.POOL_TILE_ROWS
ROW_BYTES = ir.POOL_ROW_BYTES
_itemsize = ir.pool_itemsize
panel_rows, pooled_rows, stacked_rows = ir.panel_rows, ir.pooled_rows, ir.stacked_rows


def pack_for_pool(a: np.ndarray) -> np.ndarray:
    """Host side: a [rows, cols] bf16 or uint8 matrix -> its HBM form, bf16
    [panel_rows, panels * 128] (see the module doc). Aligned bf16 comes back unchanged;
    padding is zeros."""
    a, size = _checked(a)
    rows, cols = a.shape
    pr = panel_rows(rows, a.dtype)
    data_rows = pr * (2 // size)
    padded = (data_rows, ir.round_up(cols, LANES))
    if padded != a.shape:
        a = np.pad(a, [(0, padded[0] - rows), (0, padded[1] - cols)])
    return a if size == 2 else pair_bytes_as_bf16(a)


def pair_bytes_as_bf16(a: np.ndarray) -> np.ndarray:
    """uint8 [2n, w] -> bf16 [n, w]: rows 2r and 2r + 1 become the (low, high) bytes of one
    bf16 element (little endian)."""
    n, w = a.shape[0] // 2, a.shape[1]
    pairs = np.ascontiguousarray(a.reshape(n, 2, w).transpose(0, 2, 1))
    return pairs.view(ml_dtypes.bfloat16).reshape(n, w)


def _checked(a: np.ndarray) -> tuple[np.ndarray, int]:
    a = np.asarray(a)
    if a.ndim != 2:
        raise ValueError(f"a pooled matrix is 2-D, got shape {a.shape}")
    size = _itemsize(a.dtype)
    if size == 2 and a.dtype != ml_dtypes.bfloat16:
        raise ValueError(f"2-byte pooled data must be bfloat16, not {a.dtype}")
    return a, size


def pack_stacked(a: np.ndarray) -> np.ndarray:
    """Host side: a [rows, cols] bf16 or uint8 matrix as it sits in a pool stacked, bf16
    [stacked_rows, 128]: its 128-lane column panels one under another (row i of panel p is
    matrix row p * rows + i of the stack; uint8 packed two rows per pool row as in
    ``pack_for_pool``), zero padded to whole tiles once at the end."""
    a, size = _checked(a)
    rows, cols = a.shape
    panels = -(-cols // LANES)
    a = np.pad(a, [(0, 0), (0, panels * LANES - cols)])
    stack = a.reshape(rows, panels, LANES).transpose(1, 0, 2).reshape(panels * rows, LANES)
    n = stacked_rows(rows, cols, a.dtype) * (2 // size)
    stack = np.pad(stack, [(0, n - stack.shape[0]), (0, 0)])
    return stack if size == 2 else pair_bytes_as_bf16(stack)


def pack_rows(a: np.ndarray) -> np.ndarray:
    """Host side: a [rows, cols] bf16 or uint8 matrix as it sits in a pool, bf16
    [pooled_rows, 128]: its column panels (``pack_for_pool``'s) one after another. Matrices
    packed so into one HBM array at their pool row offsets come in with one contiguous DMA
    (`mkc.runtime.experts`), whatever their widths."""
    packed = pack_for_pool(a)
    pr, width = packed.shape
    return packed.reshape(pr, width // LANES, LANES).transpose(1, 0, 2).reshape(-1, LANES)


def _row(offset: int | jax.Array) -> int | jax.Array:
    """A pool row offset as a DMA/load index: dynamic offsets are promised tile aligned, which
    Mosaic needs to address whole (16, 128) tiles."""
    return offset if isinstance(offset, (int, np.integer)) else pl.multiple_of(offset, TILE_ROWS)


def _panel_copies(hbm_ref, pool_ref, row_offset: int | jax.Array, sem) -> list:
    pr, width = hbm_ref.shape
    if pr % TILE_ROWS or width % LANES:
        raise ValueError(f"HBM form {hbm_ref.shape} is not from pack_for_pool")
    return [pltpu.make_async_copy(hbm_ref.at[:, pl.ds(p * LANES, LANES)],
                                  pool_ref.at[pl.ds(_row(row_offset + p * pr), pr)], sem)
            for p in range(width // LANES)]


def start_pooled_copy(hbm_ref, pool_ref, row_offset: int | jax.Array, sem) -> None:
    """In a kernel: start copying one matrix's HBM form (``pack_for_pool``; an ANY-space ref,
    e.g. ``w_hbm.at[expert]``) into the pool at ``row_offset`` (static, or a dynamic multiple
    of 16): one strided DMA per column panel, all signalling ``sem``."""
    for copy in _panel_copies(hbm_ref, pool_ref, row_offset, sem):
        copy.start()


def wait_pooled_copy(hbm_ref, pool_ref, row_offset: int | jax.Array, sem) -> None:
    """In a kernel: wait for a ``start_pooled_copy`` with the same arguments. One wait for the
    matrix's whole byte count: the panels are contiguous in the pool, so a descriptor over that
    row range accounts for every panel's bytes (the semaphore counts bytes, not DMAs)."""
    pr, width = hbm_ref.shape
    span = pool_ref.at[pl.ds(_row(row_offset), pr * (width // LANES))]
    pltpu.make_async_copy(span, span, sem).wait()


def pooled_matmul(h: jax.Array, pool_ref, row_offset: int | jax.Array, rows: int,
                  cols: int) -> jax.Array:
    """In a kernel: h [B, rows] (bf16 or f32, cast to bf16 as the streamed matmuls do) times
    the pooled bf16 [rows, cols] matrix at ``row_offset`` -> f32 [B, cols]; one MXU dot per
    column panel, reading only data rows (padding may hold stale or NaN bytes)."""
    h = h.astype(BF16)
    pr = panel_rows(rows, "bf16")
    with scopes.weights():
        outs = [jnp.dot(h, pool_ref[pl.ds(_row(row_offset + p * pr), rows), :],
                        preferred_element_type=F32)
                for p in range(-(-cols // LANES))]
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return out if cols % LANES == 0 else out[:, :cols]


def pooled_bf16(pool_ref, row_offset: int | jax.Array, rows: int, cols: int) -> jax.Array:
    """In a kernel: the pooled bf16 [rows, cols] matrix at ``row_offset`` as a value, for ops that
    read a weight whole rather than multiply the activation by it (absorbed MLA)."""
    pr = panel_rows(rows, "bf16")
    panels = [pool_ref[pl.ds(_row(row_offset + p * pr), rows), :] for p in range(-(-cols // LANES))]
    out = panels[0] if len(panels) == 1 else jnp.concatenate(panels, axis=1)
    return out if cols % LANES == 0 else out[:, :cols]


def pooled_u8(pool_ref, row_offset: int | jax.Array, rows: int, cols: int, *, first: int = 0,
              count: int | None = None) -> jax.Array:
    """In a kernel: rows [first, first + count) (default: all) of the pooled uint8 [rows, cols]
    matrix at ``row_offset`` -> uint8 [count, cols], e.g. one pack group of MXFP4 codes for
    ``mkc.layers.expert_formats.ops.mxfp4_dequantize_tile``. ``first`` must be a multiple of 32
    (a whole bf16 tile in)."""
    count = rows - first if count is None else count
    if first % (2 * TILE_ROWS) or first < 0 or count <= 0 or first + count > rows:
        raise ValueError(f"rows [{first}, {first}+{count}) of {rows}: first must be a multiple of "
                         f"{2 * TILE_ROWS} and the range inside the matrix")
    pr = panel_rows(rows, "u8")
    n = ir.round_up(-(-count // 2), TILE_ROWS)        # read whole tiles; bitcast doubles the rows
    panels = []
    for p in range(-(-cols // LANES)):
        packed = pool_ref[pl.ds(_row(row_offset + p * pr + first // 2), n), :]
        panels.append(pltpu.bitcast(packed, jnp.uint8)[:count])
    out = panels[0] if len(panels) == 1 else jnp.concatenate(panels, axis=1)
    return out if cols % LANES == 0 else out[:, :cols]


def pooled_stacked(pool_ref, row_offset: int | jax.Array, rows: int, cols: int,
                   dtype=jnp.uint8) -> jax.Array:
    """In a kernel: the [rows, cols] matrix of ``dtype`` (uint8 or bf16) stored stacked at
    ``row_offset`` (``pack_stacked``) as a value. Each panel is read from the whole tiles
    covering it, then cut out of them at its (static) row."""
    per_row = 2 // _itemsize(dtype)               # matrix rows per pool row
    panels = []
    for p in range(-(-cols // LANES)):
        first, end = p * rows, (p + 1) * rows    # the panel's matrix rows in the stack
        lo = first // per_row // TILE_ROWS * TILE_ROWS
        hi = ir.round_up(-(-end // per_row), TILE_ROWS)
        tiles = pool_ref[pl.ds(_row(row_offset + lo), hi - lo), :]
        if per_row == 2:
            tiles = pltpu.bitcast(tiles, jnp.uint8)
        start = first - lo * per_row
        panels.append(tiles[start:start + rows])
    out = panels[0] if len(panels) == 1 else jnp.concatenate(panels, axis=1)
    return out if cols % LANES == 0 else out[:, :cols]


# ---- a weight view: whole matrices of the next layer, prefetched by the layer before --------
@dataclass(frozen=True)
class WeightView:
    """A pool view holding each layer kind's pooled matrices: kind -> name -> (first pool row,
    rows, cols, semaphore index). HBM holds `pool__<kind>__<name>` as [layers of the kind,
    pool form]; a copy signals `pool_sem[semaphore]`."""

    pool: str
    matrices: dict[str, dict[str, tuple[int, int, int, int]]]


def _view_copy(view: WeightView, refs, kind: str, name: str, si):
    row, rows, cols, sem = view.matrices[kind][name]
    return getattr(refs, f"pool__{kind}__{name}").at[si], getattr(refs, view.pool), row, refs.pool_sem.at[sem]


def start_view(view: WeightView, refs, kind_ids: dict[str, int], layer) -> None:
    """Copy loop layer `layer`'s pooled matrices into the view (its kind is read at run time)."""
    kind, si = refs.tables[0, layer], refs.tables[2, layer]
    for name in view.matrices:
        @pl.when(kind == kind_ids[name])
        def _():
            for matrix in view.matrices[name]:
                start_pooled_copy(*_view_copy(view, refs, name, matrix, si))


def wait_matrix(view: WeightView, refs, kind: str, name: str, si) -> None:
    wait_pooled_copy(*_view_copy(view, refs, kind, name, si))

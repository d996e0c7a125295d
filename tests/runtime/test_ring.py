"""Ring streaming's host side: a matrix cut into tiles in stream order comes back whole, and
every tile's class names its family's tile shape; a matrix of 8-bit codes is packed two rows a
slot row with its scales, and its matmul in interpret mode is the emulation's."""
import numpy as np
import pytest

from mkc.runtime import ring


def test_put_tiles_round_trip_and_tile_classes():
    m = ring.StreamedMatrix("w", rows=300, cols=500, row_tiles=3, col_tiles=2, tile_rows=128,
                            tile_cols=256)
    tail = ring.StreamedMatrix("lm", rows=128, cols=128, row_tiles=1, col_tiles=1, tile_rows=128,
                               tile_cols=128)
    r = ring.Ring(slots=3, ahead=2, total_tiles=m.tiles + tail.tiles, tile_shapes=((128, 128), (128, 256)))
    hbm = np.zeros((r.total_tiles, *r.slot_shape), np.float32)
    w = np.random.default_rng(0).normal(size=(300, 500)).astype(np.float32)
    assert ring.put_tiles(hbm, 0, w, m) == m.tiles
    # tiles run column blocks outer, rows inner; zero padding past the matrix
    back = np.zeros((3 * 128, 2 * 256), np.float32)
    for t in range(m.tiles):
        j, i = divmod(t, m.row_tiles)
        back[i * 128:(i + 1) * 128, j * 256:(j + 1) * 256] = hbm[t]
    np.testing.assert_array_equal(back[:300, :500], w)
    assert not back[300:].any() and not back[:, 500:].any()
    assert ring.tile_classes(r, [m, tail]).tolist() == [1] * m.tiles + [0]


# ---- a matrix stored as 8-bit codes (`mkc.layers.dense_formats`) -----------------------------
def _codes_matrix(codes: str, rows: int, cols: int, tile_rows: int, tile_cols: int,
                  fp8_operand: bool = True):
    return ring.StreamedMatrix("w", rows=rows, cols=cols, row_tiles=-(-rows // tile_rows),
                               col_tiles=-(-cols // tile_cols), tile_rows=tile_rows,
                               tile_cols=tile_cols, codes=codes, fp8_operand=fp8_operand)


def _codes_and_scales(codes: str, rows: int, cols: int, seed: int = 0):
    """Random codes' bytes [rows, cols] and bf16-valued column scales."""
    import ml_dtypes
    rng = np.random.default_rng(seed)
    if codes == "int8":
        values = rng.integers(-127, 128, size=(rows, cols)).astype(np.int8)
    else:
        values = (rng.normal(size=(rows, cols)) * 40).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    scales = (rng.random(cols) * 0.02 + 1e-3).astype(np.float32).astype(ml_dtypes.bfloat16)
    return values, values.view(np.uint8), scales.astype(np.float32)


def test_code_tiles_hold_two_rows_a_slot_row_and_their_scales_after_the_last_row_tile():
    """A codes matrix's tiles: [tile_rows / 2, tile_cols] slot rows (rows 2a and 2a + 1 the low
    and high bytes of slot row a), each column block's last row tile with its scales in the
    next slot row; the tile classes tell the two shapes apart."""
    m = _codes_matrix("int8", 300, 500, 128, 256)
    assert (m.slot_shape(), m.slot_shape(last=True)) == ((64, 256), (80, 256))
    r = ring.Ring(slots=3, ahead=2, total_tiles=m.tiles, tile_shapes=((64, 256), (80, 256)))
    values, stored, scales = _codes_and_scales("int8", 300, 500)
    import ml_dtypes
    hbm = np.zeros((m.tiles, 80, 256), ml_dtypes.bfloat16)
    assert ring.put_tiles(hbm, 0, stored, m, scales) == m.tiles
    back = np.zeros((3 * 128, 512), np.uint8)
    for t in range(m.tiles):
        j, i = divmod(t, m.row_tiles)
        pairs = np.ascontiguousarray(hbm[t, :64]).view(np.uint8).reshape(64, 256, 2)
        back[i * 128:(i + 1) * 128, j * 256:(j + 1) * 256] = pairs.transpose(0, 2, 1).reshape(128, 256)
        if i == m.row_tiles - 1:
            np.testing.assert_array_equal(hbm[t, 64].astype(np.float32),
                                          np.pad(scales, (0, 12))[j * 256:(j + 1) * 256])
    np.testing.assert_array_equal(back[:300, :500], stored)
    assert not back[300:].any() and not back[:, 500:].any()
    assert ring.tile_classes(r, [m]).tolist() == [0, 0, 1, 0, 0, 1]


@pytest.mark.parametrize("codes,operands", [("fp8", "mixed_fp8"), ("int8", "mixed_int8"),
                                            ("fp8", "bf16")])
def test_codes_matmul_in_interpret_mode_is_the_emulation_s_dots(codes, operands):
    """`ring.matmul` of a codes matrix in TPU interpret mode (two column blocks, the second
    narrower than a whole 256-column dot, which reads on past it in its slot; three row tiles,
    the last zero padded) is bit-equal to the reference's emulation (`code_linear` of the
    codes' values times the column scales) and near the f32 product; FP8 codes fed as they
    are, or (operands "bf16": a generation without FP8 operands) converted first."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from mkc.reference.rounding import code_linear
    B, rows, cols = 2, 300, 384
    m = _codes_matrix(codes, rows, cols, 128, 256,      # columns 256 + 128, read as 256 + 256
                      fp8_operand=operands != "bf16")
    shapes = tuple(sorted({m.tile_shape(k) for k in range(m.tiles)}))
    r = ring.Ring(slots=2, ahead=2, total_tiles=m.tiles, tile_shapes=shapes)
    values, stored, scales = _codes_and_scales(codes, rows, cols, seed=1)
    import ml_dtypes
    hbm = np.zeros((m.tiles, *r.slot_shape), ml_dtypes.bfloat16)
    ring.put_tiles(hbm, 0, stored, m, scales)
    x = np.random.default_rng(2).normal(size=(B, rows)).astype(np.float32)

    def kernel(classes, x_ref, hbm_ref, out_ref, slots, sems, stage, acc):
        refs = ring.RingRefs(hbm_ref, slots, sems, classes, stage, acc)
        ring.fill(r, refs)
        out_ref[...] = ring.matmul(r, refs, x_ref[...], 0, m)

    call = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((B, m.col_tiles * m.tile_cols), jnp.float32),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((r.slots, r.slot_shape[0], 512), jnp.bfloat16),
                        pltpu.SemaphoreType.DMA((r.slots,)),
                        pltpu.VMEM((m.row_tiles, B, m.tile_rows), jnp.bfloat16),
                        pltpu.VMEM((m.col_tiles, B, m.tile_cols), jnp.float32)],
        interpret=pltpu.InterpretParams())
    got = np.asarray(call(jnp.asarray(ring.tile_classes(r, [m])), x, hbm))[:, :cols]
    xin = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    want = np.asarray(code_linear(xin, values.astype(np.float32).T, 128, operands)) * scales
    np.testing.assert_array_equal(got, want)
    plain = xin @ (values.astype(np.float64) * scales)
    np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5 * np.abs(plain).max())


@pytest.mark.parametrize("mode", ["eager", "races"])
@pytest.mark.parametrize("ahead", [1, 2, 4, 6, None])
def test_held_back_refills_start_each_later_tile_once(ahead, mode, capfd):
    """Matrices a (2 tiles) and b (4) through a ring `ahead` tiles ahead, then c (2), with a
    `refill ... after OP` whose OP reads a and b: each run starts the refills for tiles a or b
    read as it consumes them and holds back the others (`mkc.ir.held_refills`), which
    `start_after` starts once b is read, as `mkc.runtime.context` runs them. Every tile is
    copied once (no semaphore left signalled) and the three products are exact, DMAs landing
    as issued or with race detection (None: 2 ahead, nothing held)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from mkc import ir
    B, tr, tc, f32 = 8, 128, 128, jnp.float32
    mats = [ring.StreamedMatrix(name, rows=rt * tr, cols=ct * tc, row_tiles=rt, col_tiles=ct,
                                tile_rows=tr, tile_cols=tc)
            for name, rt, ct in (("a", 1, 2), ("b", 2, 2), ("c", 2, 1))]
    r = ring.Ring(slots=ahead or 2, ahead=ahead or 2, total_tiles=sum(m.tiles for m in mats),
                  tile_shapes=((tr, tc),))
    prefix = mats[0].tiles + mats[1].tiles
    held = ir.held_refills(prefix, r.ahead)
    rng = np.random.default_rng(3)
    ws = [rng.normal(size=(m.rows, m.cols)).astype(np.float32) for m in mats]
    hbm = np.zeros((r.total_tiles, tr, tc), np.float32)
    offsets = [0, mats[0].tiles, prefix]
    for off, w, m in zip(offsets, ws, mats):
        assert ring.put_tiles(hbm, off, w, m) == off + m.tiles
    x = rng.normal(size=(B, tr)).astype(np.float32)

    def kernel(classes, x_ref, hbm_ref, a_ref, b_ref, c_ref, slots, sems, stage, acc):
        refs = ring.RingRefs(hbm_ref, slots, sems, classes, stage, acc)
        ring.fill(r, refs)
        h = x_ref[...]
        for i, (m, out) in enumerate(zip(mats, (a_ref, b_ref, c_ref))):
            refills = held.start - offsets[i] if ahead and i < 2 else None
            out[...] = h = ring.matmul(r, refs, h, offsets[i], m, refills)
            if ahead and i == 1:
                ring.start_after(r, refs, 0, prefix)

    call = pl.pallas_call(
        kernel, out_shape=tuple(jax.ShapeDtypeStruct((B, m.cols), f32) for m in mats),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=tuple(pl.BlockSpec(memory_space=pltpu.VMEM) for _ in mats),
        scratch_shapes=[pltpu.VMEM((r.slots, tr, tc), f32), pltpu.SemaphoreType.DMA((r.slots,)),
                        pltpu.VMEM((2, B, tr), jnp.bfloat16), pltpu.VMEM((2, B, tc), f32)],
        interpret=pltpu.InterpretParams(**(
            dict(dma_execution_mode="eager") if mode == "eager" else
            dict(dma_execution_mode="on_wait", detect_races=True, vector_clock_size=8))))
    outs = [np.asarray(o) for o in call(jnp.asarray(ring.tile_classes(r, mats)), x, hbm)]
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    assert mode == "eager" or not ipc.races.races_found
    # interpret mode prints a semaphore a copy started twice left signalled
    assert "non-zero count" not in capfd.readouterr().out
    h = x
    for o, w in zip(outs, ws):
        h = np.asarray(jnp.asarray(h).astype(jnp.bfloat16).astype(f32)) @ w
        np.testing.assert_allclose(o, h, rtol=2e-5, atol=2e-4 * np.abs(h).max())
        h = o

"""Pooled matrices (``mkc.runtime.pool``): bf16 weights and MXFP4 expert codes/scales DMA'd into one
bf16 VMEM pool at static or dynamic (SMEM) row offsets, multiplied and dequantised in TPU
interpret mode against numpy; the packed size against the layout; and the same kernel at
full Kimi K3 size compiled for tpu7x (run as a script: ``python tests/ops/test_pool.py``)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc.model.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from mkc.runtime import pool
from mkc.layers.expert_formats.ops import mxfp4_dequantize_tile, mxfp4_scale_bias
from mkc.layers.expert_formats.weights import pack_mxfp4_for_kernel

F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32
GAP = 16   # pool rows left between matrices, so no offset is 0 or back to back


def _layout(mats: list[tuple[int, int]], n_in: int, n_out: int) -> tuple[list[int], int]:
    """Row offsets of (bf16 mats..., codes, scales), placed scales first and the mats
    reversed so offsets do not follow argument order; and the pool's rows."""
    sizes = [pool.pooled_rows(k, n, "bf16") for k, n in mats]
    sizes += [pool.pooled_rows(n_in // 2, n_out, "u8"), pool.pooled_rows(n_in // 32, n_out, "u8")]
    order = [len(sizes) - 1, *reversed(range(len(mats))), len(mats)]
    offsets, row = [0] * len(sizes), GAP
    for i in order:
        offsets[i], row = row, row + sizes[i] + GAP
    return offsets, row


def pool_kernel(mats: list[tuple[int, int]], n_in: int, n_out: int, group: int, batch: int,
                dynamic: bool, interpret: bool, emit_weights: bool):
    """pallas_call(offsets, xs..., x_expert, w_hbm..., codes_hbm, scales_hbm) -> (x_i @ w_i...,
    x_expert @ dequant(expert)[, dequantised expert f32]); every matrix goes through the pool."""
    offsets, rows = _layout(mats, n_in, n_out)
    n = len(mats)

    def kernel(offs_ref, *refs):
        xs, xe, hbm = refs[:n], refs[n], refs[n + 1:2 * n + 3]
        outs, pool_ref, sems = refs[2 * n + 3:-2], refs[-2], refs[-1]
        offs = [pl.multiple_of(offs_ref[i], 16) for i in range(n + 2)] if dynamic else offsets
        for i, src in enumerate(hbm):       # all copies in flight at once, one semaphore each
            pool.start_pooled_copy(src, pool_ref, offs[i], sems.at[i])
        for i, src in enumerate(hbm):
            pool.wait_pooled_copy(src, pool_ref, offs[i], sems.at[i])
        for i, (k, c) in enumerate(mats):
            outs[i][...] = pool.pooled_matmul(xs[i][...], pool_ref, offs[i], k, c)
        scales = pool.pooled_u8(pool_ref, offs[n + 1], n_in // 32, n_out)
        acc, bias = jnp.zeros((batch, n_out), F32), mxfp4_scale_bias(scales)
        for g in range(n_in // group):      # one pack group of input rows at a time
            codes = pool.pooled_u8(pool_ref, offs[n], n_in // 2, n_out, first=g * group // 2,
                                   count=group // 2)
            w = mxfp4_dequantize_tile(codes, bias[g * group // 32:(g + 1) * group // 32], BF16)
            acc += jnp.dot(xe[:, g * group:(g + 1) * group].astype(BF16), w, preferred_element_type=F32)
            if emit_weights:
                outs[n + 1][g * group:(g + 1) * group, :] = w.astype(F32)
        outs[n][...] = acc

    out_shape = [jax.ShapeDtypeStruct((batch, c), F32) for _, c in mats]
    out_shape.append(jax.ShapeDtypeStruct((batch, n_out), F32))
    if emit_weights:
        out_shape.append(jax.ShapeDtypeStruct((n_in, n_out), F32))
    vmem, smem = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pltpu.SMEM)
    call = pl.pallas_call(
        kernel, out_shape=tuple(out_shape),
        in_specs=[smem] + [vmem] * (n + 1) + [pl.BlockSpec(memory_space=pl.ANY)] * (n + 2),
        out_specs=tuple(vmem for _ in out_shape),
        scratch_shapes=[pltpu.VMEM((rows, 128), BF16), pltpu.SemaphoreType.DMA((n + 2,))],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=60 * 2**20),
        interpret=pltpu.InterpretParams() if interpret else False)
    return call, np.asarray(offsets, np.int32)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_pool_matmuls_and_mxfp4_expert_match_numpy(dynamic: bool) -> None:
    rng = np.random.default_rng(0)
    mats, batch, n_in, n_out, group = [(512, 384), (384, 512)], 8, 256, 320, 128
    ws = [rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in mats]
    xs = [rng.standard_normal((batch, k)).astype(ml_dtypes.bfloat16) for k, _ in mats]
    # One expert's gate_up (320 outputs: a part panel), quantized from real-valued weights.
    codes, scales = mxfp4_quantize(rng.standard_normal((n_out, n_in)))
    codes_k, scales_k = pack_mxfp4_for_kernel(codes, scales, group)
    xe = rng.standard_normal((batch, n_in)).astype(np.float32)

    call, offsets = pool_kernel(mats, n_in, n_out, group, batch, dynamic, True, True)
    hbm = [pool.pack_for_pool(a) for a in (*ws, codes_k, scales_k)]
    assert hbm[0] is ws[0] and hbm[2].shape == (64, 384) and hbm[3].shape == (16, 384)
    *ys, ye, deq = call(jnp.asarray(offsets), *map(jnp.asarray, xs), jnp.asarray(xe),
                        *map(jnp.asarray, hbm))

    for x, w, y in zip(xs, ws, ys):
        want = x.astype(np.float32) @ w.astype(np.float32)
        np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-3)
    want_w = mxfp4_dequantize(codes, scales, (n_out, n_in)).T
    np.testing.assert_array_equal(deq, want_w)        # normal scales: exact in bf16
    want_e = xe.astype(ml_dtypes.bfloat16).astype(np.float32) @ want_w
    np.testing.assert_allclose(ye, want_e, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rows, cols, dtype", [
    (512, 384, "bf16"), (7168, 1664, "bf16"), (100, 200, "bf16"), (1792, 1536, "u8"),
    (112, 1536, "u8"), (8, 320, "u8"), (33, 129, "u8"), (1, 1, "u8"), (384, 96, "u8")])
def test_pooled_rows_is_the_packed_size(rows: int, cols: int, dtype: str) -> None:
    """What resolve budgets for a pooled matrix is exactly what the kernel copies."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bf16" else np.uint8
    packed = pool.pack_for_pool(np.ones((rows, cols), np_dtype))
    assert packed.dtype == ml_dtypes.bfloat16
    assert packed.size == pool.pooled_rows(rows, cols, dtype) * pool.LANES


def test_pack_for_pool_u8_pairs_rows_low_byte_first() -> None:
    a = np.arange(6 * 130, dtype=np.uint32).reshape(6, 130).astype(np.uint8)
    packed = pool.pack_for_pool(a)
    assert packed.shape == (16, 256)
    bits = packed.view(np.uint16)
    np.testing.assert_array_equal(bits[:3, :130], a[0::2] | (a[1::2].astype(np.uint16) << 8))
    assert not bits[3:].any() and not bits[:, 130:].any()
    with pytest.raises(ValueError):
        pool.pack_for_pool(np.ones((4, 4), np.float32))


@pytest.mark.parametrize("rows, cols, dtype", [(100, 200, "bf16"), (33, 300, "u8"), (7, 1536, "u8")])
def test_pack_rows_is_the_pool_image_of_the_panels(rows: int, cols: int, dtype: str) -> None:
    """A matrix as it sits in the pool: `pack_for_pool`'s column panels one after another, so
    one contiguous copy of it lands what a copy per panel would."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bf16" else np.uint8
    a = np.random.default_rng(0).integers(0, 250, (rows, cols)).astype(np_dtype)
    panels, image = pool.pack_for_pool(a), pool.pack_rows(a)
    pr = pool.panel_rows(rows, dtype)
    assert image.shape == (pool.pooled_rows(rows, cols, dtype), pool.LANES)
    for p in range(panels.shape[1] // pool.LANES):
        np.testing.assert_array_equal(image[p * pr:(p + 1) * pr].view(np.uint16),
                                      panels[:, p * pool.LANES:(p + 1) * pool.LANES].view(np.uint16))


def stacked_kernel(rows: int, cols: int, dtype, interpret: bool):
    """pallas_call(offset, image_hbm) -> the [rows, cols] matrix read back with
    `pooled_stacked` after one copy of its stacked image (`pack_stacked`) into a pool at a
    dynamic row offset (SMEM, a tile multiple)."""
    n = pool.stacked_rows(rows, cols, np.dtype(dtype))

    def kernel(off_ref, hbm, out, pool_ref, sem):
        off = pl.multiple_of(off_ref[0], 16)
        cp = pltpu.make_async_copy(hbm, pool_ref.at[pl.ds(off, n)], sem)
        cp.start()
        cp.wait()
        out[...] = pool.pooled_stacked(pool_ref, off, rows, cols, dtype)

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, cols), dtype),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM((n + 3 * GAP, 128), BF16), pltpu.SemaphoreType.DMA(())],
        interpret=pltpu.InterpretParams() if interpret else False)


STACKED = [(7, 300, "u8"), (6, 512, "u8"), (33, 129, "u8"), (1, 1, "u8"), (64, 384, "u8"),
           (5, 200, "bf16"), (17, 256, "bf16")]


@pytest.mark.parametrize("rows, cols, dtype", STACKED)
def test_a_stacked_matrix_reads_back_whole(rows: int, cols: int, dtype: str) -> None:
    """`pack_stacked` then `pooled_stacked` (interpret mode) is the identity, bit for bit; the
    image is `stacked_rows` pool rows, the panels one under another in its leading rows."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bf16" else np.uint8
    a = np.random.default_rng(rows * cols).integers(0, 250, (rows, cols)).astype(np_dtype)
    image = pool.pack_stacked(a)
    assert image.shape == (pool.pooled_rows(rows, cols, dtype, stacked=True), pool.LANES)
    stack = np.pad(a, [(0, 0), (0, -cols % 128)]).reshape(rows, -1, 128).transpose(1, 0, 2)
    stack = stack.reshape(-1, 128)
    as_rows = image.view(np.uint8).reshape(-1, 128, 2).transpose(0, 2, 1).reshape(-1, 128) \
        if dtype == "u8" else image
    np.testing.assert_array_equal(as_rows[:stack.shape[0]].view(np.uint8),
                                  stack.view(np.uint8))
    assert not as_rows[stack.shape[0]:].view(np.uint8).any()
    got = stacked_kernel(rows, cols, np_dtype, True)(jnp.asarray([2 * GAP], jnp.int32),
                                                     jnp.asarray(image))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), a.view(np.uint8))


def test_stacked_k3_scales_drop_the_panel_padding() -> None:
    """K3's FP8 expert scales per rank (gate|up [7, 1536], down [6, 3584]): 640 pool rows as
    whole-tile panels (160 KiB an expert copy), 144 stacked (36 KiB, for 31.5 KiB of scales)."""
    shapes = [(7, 1536), (6, 3584)]
    assert sum(pool.pooled_rows(r, c, "u8") for r, c in shapes) == 640
    assert sum(pool.pooled_rows(r, c, "u8", stacked=True) for r, c in shapes) == 144


def compile_full_size() -> None:
    """Lower and compile the pool kernel at Kimi K3 size for tpu7x (no TPU needed)."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mats, n_in, n_out, group, batch = [(7168, 1664)], 3584, 1536, 512, 8
    call, offsets = pool_kernel(mats, n_in, n_out, group, batch, True, False, False)
    topo = topologies.get_topology_desc("tpu7x=2x2x1", platform="tpu")
    mesh = Mesh(np.array(topo.devices[:1]), ("x",))
    sharding = NamedSharding(mesh, P())
    shapes = [(offsets.shape, I32), ((batch, 7168), BF16), ((batch, n_in), F32),
              ((7168, 1664), BF16), ((n_in // 4, n_out), BF16), ((64, n_out), BF16)]
    assert [pool.pack_for_pool(np.zeros(s, d)).shape for s, d in
            [((7168, 1664), ml_dtypes.bfloat16), ((1792, 1536), np.uint8), ((112, 1536), np.uint8)]
            ] == [s for s, _ in shapes[3:]]
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    step = jax.shard_map(call, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False)
    jax.jit(step).lower(*args).compile()
    for rows, cols in ((7, 1536), (6, 3584), (112, 1536), (24, 3584)):   # K3's expert scales
        image = (pool.stacked_rows(rows, cols, "u8"), 128)
        jax.jit(stacked_kernel(rows, cols, np.uint8, False)).lower(
            jax.ShapeDtypeStruct((1,), I32, sharding=sharding),
            jax.ShapeDtypeStruct(image, BF16, sharding=sharding)).compile()
    print("compiled for tpu7x")


def test_full_size_pool_kernel_compiles_for_tpu7x() -> None:
    from conftest import run_python
    r = run_python([str(Path(__file__).resolve())], timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "compiled for tpu7x" in r.stdout


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # libtpu's lockfile, no TPU here
    sys.exit(compile_full_size())


def test_aligned_matrices_take_exactly_their_bytes() -> None:
    assert pool.pooled_rows(7168, 1664, "bf16") * pool.ROW_BYTES == 7168 * 1664 * 2
    assert pool.pooled_rows(1792, 1536, "u8") * pool.ROW_BYTES == 1792 * 1536
    assert pool.pooled_rows(112, 1536, "u8") * pool.ROW_BYTES == 128 * 1536   # padded to a tile

"""The routed experts' lowered matmul (`mkc.layers.expert_formats.lowering.expert_matmul`, what
a routed-experts body calls for a selected expert's matrix) on slots packed as the kernel holds
them, against f64 products of the checkpoint's values: MXFP4 codes decoded per pack group
under their 32-row scales, and an FP8 checkpoint's codes under its 128 x 128 block scales (two
pack groups each, so the groups' sum acts). The slot's reads (`expert_slots.matrix`,
`read_u8`, `pool.pooled_u8`) return the packed arrays; the rest is the body's own. They agree
to 1e-5; a 1.01 scale of a group's partial product, of its scales or of its codes' decoding
moves them by more (each mutant applied to the source and this module run: every one failed).

Mutants (mkc/layers/expert_formats/lowering.py unless named), 1.01 times ...
  an MXFP4 group's product; the later groups' sum; the FP8 blocks' row scales; a later FP8
  block group's product; ops.mxfp4_dequantize_tile's values (expert_formats/ops.py)
"""
from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

from mkc.ir import WeightFormat
from mkc.layers.expert_formats.weights import fp8_checkpoint_blocks, pack_mxfp4_for_kernel
from layer_bodies import lowered_expert_matmul
from mkc.model import fp8_blocks
from mkc.model.mxfp4 import mxfp4_dequantize

N_OUT, N_IN = 256, 512


def _lowered(fmt: WeightFormat, codes: np.ndarray, scales: np.ndarray, x: np.ndarray, group: int
             ) -> np.ndarray:
    return lowered_expert_matmul(fmt, codes, scales, x, group).astype(np.float64)


def _x(seed: int) -> np.ndarray:
    """Rows the MXU takes as they are (bf16 values)."""
    return np.random.default_rng(seed).normal(0, 1, (3, N_IN)).astype(ml_dtypes.bfloat16).astype(np.float32)


def _close(got, want) -> None:
    assert np.max(np.abs(got - want)) < 1e-5 * np.max(np.abs(want))


def test_mxfp4_codes_decoded_per_pack_group():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (N_OUT, N_IN // 2), dtype=np.uint8)
    scales = rng.integers(122, 130, (N_OUT, N_IN // 32), dtype=np.uint8)
    group = 256
    packed, packed_scales = pack_mxfp4_for_kernel(codes, scales, group)
    x = _x(2)
    want = x.astype(np.float64) @ mxfp4_dequantize(codes, scales, (N_OUT, N_IN)).astype(np.float64).T
    _close(_lowered(WeightFormat("mxfp4", block=32), packed, packed_scales, x, group), want)


@pytest.mark.parametrize("feeds_codes", [True, False])
def test_fp8_checkpoint_codes_under_their_block_scales(feeds_codes):
    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, (N_OUT, N_IN)) * rng.uniform(0.1, 10, (N_OUT // 128, 1, N_IN // 128)).repeat(
        128, 0).reshape(N_OUT, 1, -1).repeat(128, 2).reshape(N_OUT, N_IN)
    codes, scale_inv = fp8_blocks.quantize(w, (128, 128))
    fmt = WeightFormat("fp8", block=128, cols=128, fp8_operand=feeds_codes)
    packed, packed_scales = fp8_checkpoint_blocks(codes, scale_inv, range(N_OUT), range(N_IN), fmt, N_OUT)
    x = _x(4)
    want = x.astype(np.float64) @ fp8_blocks.dequantize(codes, scale_inv, (128, 128)).astype(np.float64).T
    _close(_lowered(fmt, packed, packed_scales, x, 128), want)

"""NVFP4 checkpoints' scales (NVIDIA ModelOpt's; Muse Spark's `-NVFP4` release): the one home
of their names and ranges, which the checkpoint loader checks every stored scale against and
the packer (`mkc.layers.expert_formats.weights.pack_nvfp4_for_kernel`) every scale it packs.

A matrix's value is `e2m1 code x e4m3 block scale x f32 global scale`: the block scale
(`weight_scale`, or a fused expert tensor's `_weight_scale`, one per 16 inputs) is stored as
float8_e4m3fn, the global scale (`weight_scale_2`, one per matrix) as f32. ModelOpt writes the
block scale as the block's largest magnitude over 6 x the global scale (a block of zeros: 1)
and the global scale as the matrix's largest magnitude over 6 x 448.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from mkc.model.fp8_blocks import E4M3_MAX
from mkc.model.scales import ScaleRange

E2M1_MAX = 6.0                        # e2m1's largest magnitude
BLOCK_SCALE_SUFFIX = "weight_scale"   # its dtype float8_e4m3fn (MXFP4's E8M0 `weight_scale` is uint8)
GLOBAL_SCALE_SUFFIX = "weight_scale_2"
BLOCK_SCALE_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)

# A block scale is a positive normal e4m3 value (2**-6 to 448): NaN, 0 (ModelOpt writes 1 for
# a block of zeros) and a negative one (it flips the block's signs) are no scale of a block of
# weights; a subnormal one would be a block 28,672 times under its matrix's largest value.
BLOCK_SCALES = ScaleRange("e4m3 block scale(s)", float(ml_dtypes.finfo(BLOCK_SCALE_DTYPE).smallest_normal),
                          E4M3_MAX, "a positive normal e4m3 value")
# A global scale is an f32 normal under which the largest value (6 x 448 x the scale) squared
# stays finite in f32: the experts' gated product multiplies gate's output by up's, each scaled
# by it (a 3e38 one served infinities as a model; under 1e30 a weight of 1e33 squares past f32).
# ModelOpt's, the largest weight over 2688, lies far inside.
GLOBAL_SCALE_MAX = math.sqrt(float(np.finfo(np.float32).max)) / (E2M1_MAX * E4M3_MAX)
GLOBAL_SCALES = ScaleRange("global scale(s)", float(np.finfo(np.float32).tiny), GLOBAL_SCALE_MAX,
                           "an f32 normal under which 6 x 448 x the scale, squared, stays finite in f32")


def block_scale_values(scales) -> np.ndarray:
    """Block scales given as float8_e4m3fn values or as their bytes (uint8), as e4m3 values."""
    a = np.asarray(scales)
    return a.view(BLOCK_SCALE_DTYPE) if a.dtype == np.uint8 else a.astype(BLOCK_SCALE_DTYPE)

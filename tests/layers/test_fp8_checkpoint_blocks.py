"""`format expert.* fp8 block 128 x 128`: an FP8 checkpoint's routed experts (DeepSeek-V3's: e4m3
codes beside an f32 `weight_scale_inv` per 128 x 128 block of `[out, in]`) held as they are.

- the checkpoint format (`mkc.model.fp8_blocks`): DeepSeek's recipe draws a scale per block of
  its largest magnitude / 448 and the nearest e4m3 code, started blocks included, and a value is
  the code times its block's scale in f32;
- packing is exact: every rank's slot codes and scales, read back, are the checkpoint's values
  (scale x code) of its slice of each expert, under the shipped layout (EP2 x TP8: slices
  narrower than a block) and with whole experts;
- the lowering's group dots, each partial product times its scales, equal the rounding
  emulation bit for bit in interpret mode, and scales read in the wrong order do not;
- a spec asking the checkpoint's blocks of a checkpoint without them, other blocks, `rounded`,
  or a rank slice cutting blocks unevenly, is refused naming what is accepted.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc.families.deepseek_v3 import reference as ref
from mkc.families.deepseek_v3.graph import MOE
from mkc.ir import WeightFormat
from mkc.layers.expert_formats import block_groups, block_index, ops, resolve
from mkc.layers.expert_formats.weights import (fp8_checkpoint_blocks, pack_block_scales,
                                               unpack_block_scales)
from mkc.layers.moe.weights import expert, expert_slice
from mkc.model import fp8_blocks
from mkc.model.config import CONFIG_DIR
from mkc.model.family import FormatError
from mkc.model.sharding import ShardTable
from mkc.reference.rounding import chunked_linear

F32, BF16 = jnp.float32, jnp.bfloat16
BLOCKS = WeightFormat("fp8", 128, cols=128)
MINI = ref.load_config(CONFIG_DIR / "deepseek_v3_mini_fp8.json")
EXPERTS = "model.layers.1.mlp.experts."


@pytest.fixture(scope="module")
def hf():
    return ref.init_params(MINI, seed=0)


def test_the_checkpoint_format_is_deepseek_s_recipe():
    """A scale per started 128 x 128 block (a [320, 256] weight has 3 x 2), its largest
    magnitude / 448, each code the e4m3 value nearest value / scale; values are f32 code x
    scale, the bf16 weight DeepSeek's fp8_cast_bf16 writes those rounded."""
    rng = np.random.default_rng(0)
    w = rng.normal(0.0, 0.05, (320, 256)).astype(np.float32)
    codes, scales = fp8_blocks.quantize(w, (128, 128))
    assert codes.dtype == ml_dtypes.float8_e4m3fn and scales.shape == (3, 2)
    assert scales[2, 1] == np.abs(w[256:, 128:]).max() / np.float32(448)
    top = np.unravel_index(np.abs(w[:128, :128]).argmax(), (128, 128))
    assert abs(float(codes[top])) == 448.0
    expect = (w / np.repeat(np.repeat(scales, 128, 0), 128, 1)[:320]).astype(ml_dtypes.float8_e4m3fn)
    assert (codes.view(np.uint8) == expect.view(np.uint8)).all()
    values = fp8_blocks.dequantize(codes, scales, (128, 128))
    assert values[300, 200] == np.float32(codes[300, 200]) * scales[2, 1]
    assert np.abs(values - w).max() <= np.abs(w).max() / 16
    widened = fp8_blocks.widen(codes, scales, (128, 128))
    assert widened.dtype == ml_dtypes.bfloat16 and (widened == values.astype(ml_dtypes.bfloat16)).all()


def test_block_scales_round_trip_through_their_bytes():
    rng = np.random.default_rng(1)
    s = rng.uniform(1e-5, 1e-3, (3, 5)).astype(np.float32)
    stored = pack_block_scales(s)
    assert stored.shape == (4 * 8, 5) and stored.dtype == np.uint8 and not stored[12:].any()
    assert (unpack_block_scales(stored, 3) == s).all()


@pytest.mark.parametrize("tp", [8, 1], ids=["tp8", "whole"])
@pytest.mark.parametrize("matrix", ["gate_up", "down"])
def test_every_rank_s_slot_holds_the_checkpoint_s_values_exactly(hf, matrix, tp):
    """Slot codes x slot scales = the checkpoint's scale x code of the rank's slice, for every
    width part (the shipped layout's 32-wide slices: a quarter of a 128-column block)."""
    stored = EXPERTS + {"gate_up": "gate_up_proj", "down": "down_proj"}[matrix]
    e = 7
    values = fp8_blocks.dequantize(hf[stored][e], hf[stored + "_scale_inv"][e], (128, 128))
    for part in range(tp):
        out_index, in_index, width = expert_slice(MINI, matrix, part, tp)
        codes, scales = fp8_checkpoint_blocks(hf[stored][e], hf[stored + "_scale_inv"][e], out_index,
                                              in_index, BLOCKS, width)
        group, per = block_groups(BLOCKS, len(in_index), width)
        s = unpack_block_scales(scales, len(in_index) // group)
        held = (codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
                * np.repeat(np.repeat(s, group, 0), per, 1))
        assert (held == values[np.ix_(out_index, in_index)].T).all()
        raw = hf[stored][e].view(np.uint8)[np.ix_(out_index, in_index)].T
        assert (codes == raw).all()                     # the checkpoint's bytes


def test_the_packer_gives_each_rank_its_slice(hf):
    """`expert` (what place_weights packs) on the shipped rules: rank 11 is part 3 of expert
    group 1, its local expert 2 the model's expert 18."""
    shards = ShardTable.of({"heads": (16, 1), "mlp": (16, 1), "vocab": (16, 1), "experts": (2, 8),
                            "expert_mlp": (8, 1)}, 16)
    got = expert(MOE, hf, MINI, "model.layers.1.", 2, 11, shards)
    assert set(got) == {"gate_up_codes", "gate_up_scales", "down_codes", "down_scales"}
    out_index, in_index, width = expert_slice(MINI, "down", 3, 8)
    want, _ = fp8_checkpoint_blocks(hf[EXPERTS + "down_proj"][18], hf[EXPERTS + "down_proj_scale_inv"][18],
                                    out_index, in_index, BLOCKS, width)
    assert (got["down_codes"] == want).all() and got["down_codes"].shape == (32, 256)


def _kernel_matmul(x, codes, scales, groups: int, group: int, cols: int):
    """The lowering's `fp8 block R x C` product (`lowering._checkpoint_blocks_matmul`) on VMEM
    values, in interpret mode."""
    def body(x_ref, c_ref, s_ref, o_ref):
        rows = ops.block_scales(s_ref[...], groups, cols // s_ref.shape[1])
        out = None
        for g in range(groups):
            part = ops.fp8_group_matmul(x_ref[:, g * group:(g + 1) * group].astype(BF16),
                                        c_ref[g * group:(g + 1) * group, :], rows[g:g + 1], True)
            out = part if out is None else out + part
        o_ref[...] = out
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    return np.asarray(pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((x.shape[0], cols), F32),
                                     in_specs=[vmem] * 3, out_specs=vmem,
                                     interpret=pltpu.InterpretParams())(x, codes, scales))


@pytest.mark.parametrize("matrix,part,tp", [("gate_up", 3, 8), ("down", 5, 8), ("gate_up", 0, 1)])
def test_the_kernel_s_group_dots_equal_the_emulation_bit_for_bit(hf, matrix, part, tp):
    stored = EXPERTS + {"gate_up": "gate_up_proj", "down": "down_proj"}[matrix]
    e = 3
    out_index, in_index, width = expert_slice(MINI, matrix, part, tp)
    codes, scales = fp8_checkpoint_blocks(hf[stored][e], hf[stored + "_scale_inv"][e], out_index, in_index,
                                          BLOCKS, width)
    rows, cols = codes.shape
    group, _ = block_groups(BLOCKS, rows, width)
    x = np.random.default_rng(2).normal(size=(2, rows)).astype(np.float32).astype(ml_dtypes.bfloat16)
    kernel = _kernel_matmul(x, codes, scales, rows // group, group, cols)
    block_rows, block_cols = block_index(BLOCKS, out_index, in_index, width)
    scale = jnp.asarray(hf[stored + "_scale_inv"][e])[jnp.asarray(block_cols)][:, jnp.asarray(block_rows)].T
    w = jnp.asarray(hf[stored][e]).astype(F32)[np.ix_(out_index, in_index)]
    x32 = jnp.asarray(x.astype(np.float32))
    emulated = np.asarray(chunked_linear(x32, w, group, "mixed_fp8", scale))
    assert (kernel == emulated).all()
    if rows // group > 1:          # the scales of the groups swapped: no longer equal
        assert not (kernel == np.asarray(chunked_linear(x32, w, group, "mixed_fp8", scale[::-1]))).all()
    plain = np.asarray(x32) @ np.asarray(fp8_blocks.dequantize(hf[stored][e], hf[stored + "_scale_inv"][e],
                                                               (128, 128)))[np.ix_(out_index, in_index)].T
    assert np.abs(kernel - plain).max() <= 1e-5 * np.abs(plain).max()


def _resolve(fmt: WeightFormat, d=MINI, tp: int = 8):
    return MOE.expert_formats(d, {"expert.gate_up": fmt, "expert.down": fmt}, tp)


def test_the_checkpoint_s_blocks_are_its_default_and_resolve_to_themselves():
    assert set(MOE.expert_formats(MINI, None, 8).values()) == {BLOCKS}
    assert set(_resolve(WeightFormat("fp8")).values()) == {BLOCKS}
    assert MOE.weight_formats(MINI) == (("expert.gate_up", ("fp8",)), ("expert.down", ("fp8",)))


@pytest.mark.parametrize("fmt,words,hint", [
    (WeightFormat("fp8", 256, cols=128), "would requantize", "fp8 block 128 x 128"),
    (WeightFormat("fp8", 128), "would requantize", "fp8 block 128 x 128"),
    (WeightFormat("fp8", 128, cols=128, rounded=True), "nothing is rounded", "no `rounded`"),
])
def test_other_blocks_of_the_fp8_checkpoint_are_refused(fmt, words, hint):
    with pytest.raises(FormatError, match=words) as e:
        _resolve(fmt)
    assert hint in e.value.hint and e.value.cls.startswith("expert.")


def test_the_checkpoint_s_blocks_of_a_bf16_checkpoint_are_refused():
    bf16 = ref.load_config(CONFIG_DIR / "deepseek_v3_mini.json")
    with pytest.raises(FormatError, match="is bf16") as e:
        _resolve(BLOCKS, bf16)
    assert "fp8 block N rounded" in e.value.hint


def test_a_width_slice_cutting_blocks_unevenly_is_refused():
    """48 columns of a 128-column block a rank (moe width 384 over 8): scales would straddle."""
    with pytest.raises(FormatError, match="unevenly") as e:
        resolve(MOE.weight_formats(MINI), {"gate_up": 256, "down": 48}, {"gate_up": 256, "down": 48},
                {"expert.gate_up": BLOCKS, "expert.down": BLOCKS}, (128, 128), {"gate_up": 48, "down": 256})
    assert "expert_mlp" in e.value.hint

"""`format expert.* fp4|fp8 block N rounded scale bf16`: a rounded block's scale a bf16 value
searched for the least squared error. Never further from the checkpoint than E8M0's power of
two, exact where that is; held in a slot as two bytes a scale and decoded exactly by the kernel;
the kernel's group dots equal the emulation's bit for bit; and a requantized checkpoint packs to
the kernel weights the checkpoint itself packs to (Kimi K3's FP4, the library MoE's FP8)."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc.ir import WeightFormat
from mkc.layers.expert_formats import ops, tensors
from mkc.layers.expert_formats.weights import pack_bf16_scales, unpack_bf16_scales
from mkc.model import mxfp4
from mkc.model.config import CONFIG_DIR
from mkc.model.sharding import ShardTable
from mkc.reference.rounding import chunked_linear

F32 = jnp.float32


def _spread_mxfp4(shape: tuple[int, int], octaves: int, seed: int):
    """Gaussian weights as MXFP4, every 32-row scale lowered by 0..`octaves` at random."""
    rng = np.random.default_rng(seed)
    codes, scales = mxfp4.mxfp4_quantize(rng.normal(0, 1 / 16, shape))
    lowered = scales.astype(int) - rng.integers(0, octaves + 1, scales.shape)
    return codes, np.maximum(lowered, 1).astype(np.uint8)


@pytest.mark.parametrize("octaves", [0, 2, 4])
def test_fp4_searched_scales_are_bf16_values_never_worse_than_e8m0_per_block(octaves):
    codes, scales = _spread_mxfp4((32, 2048), octaves, octaves)
    values = mxfp4.mxfp4_dequantize(codes, scales, (32, 2048)).astype(np.float64).reshape(32, 4, 512)
    e8m0 = mxfp4.requantize_blocks(codes, scales, 512)
    bf16 = mxfp4.requantize_blocks(codes, scales, 512, "bf16")
    assert bf16.scales.dtype == np.float32 and bf16.scales.shape == (32, 4)
    assert np.array_equal(bf16.scales.astype(ml_dtypes.bfloat16).astype(np.float32), bf16.scales)

    def block_err(r):
        held = mxfp4.mxfp4_dequantize(r.codes, np.full((32, 64), 127, np.uint8), (32, 2048))
        new = held.astype(np.float64).reshape(32, 4, 512) * r.scale_values()[..., None]
        return ((new - values) ** 2).sum(-1)

    assert np.all(block_err(bf16) <= block_err(e8m0))
    assert bf16.sq_err == pytest.approx(block_err(bf16).sum()) and bf16.sq_err < e8m0.sq_err
    if octaves:            # spread scales: the search gains most (docs/formats.md#which-block-scale)
        assert bf16.sq_err < 0.85 * e8m0.sq_err
    with pytest.raises(ValueError, match="not MXFP4 scales"):
        bf16.scales_per_32()


def test_a_block_e8m0_holds_exactly_stays_as_it_was():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (8, 256)).astype(np.uint8)
    codes[:, 0] = 0x77                                  # every block holds a 6
    scales = np.repeat(rng.integers(110, 130, (8, 1)), 16, axis=1).astype(np.uint8)
    r = mxfp4.requantize_blocks(codes, scales, 512, "bf16")
    assert r.exact and r.max_abs == 0.0
    np.testing.assert_array_equal(r.scale_values()[:, 0], np.ldexp(1.0, scales[:, 0].astype(int) - 127))


@pytest.mark.parametrize("largest, code", [(6.0, ml_dtypes.float4_e2m1fn), (448.0, ml_dtypes.float8_e4m3fn)])
def test_a_block_of_tiny_values_keeps_a_normal_scale(largest, code):
    """Values so small their holding scale would be subnormal (which a TPU flushes to zero) take
    E8M0's smallest, 2**-126, as E8M0 requantization clips it."""
    blocked = np.ldexp(np.linspace(-1.0, 1.0, 64), -127).reshape(1, 2, 32)
    _, scales = mxfp4.searched_bf16_scales(blocked, largest, code)
    assert np.all(scales >= 2.0 ** -126) and np.all(scales == 2.0 ** -126)


def test_fp8_searched_scales_never_worse_and_an_all_zero_block_takes_scale_one():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((6, 1024)) * np.exp2(rng.integers(-20, 20, (6, 1)))).astype(
        ml_dtypes.bfloat16).astype(np.float64)
    w[5, 512:] = 0.0
    e8m0 = mxfp4.requantize_fp8_blocks(w, 512)
    bf16 = mxfp4.requantize_fp8_blocks(w, 512, "bf16")
    err = {k: ((mxfp4.fp8_block_values(r) - w) ** 2).reshape(6, 2, 512).sum(-1) for k, r in
           (("e8m0", e8m0), ("bf16", bf16))}
    assert np.all(err["bf16"] <= err["e8m0"]) and bf16.sq_err < e8m0.sq_err
    assert bf16.scales[5, 1] == 1.0 and not mxfp4.fp8_block_values(bf16)[5, 512:].any()
    assert np.all(np.abs(mxfp4.fp8_block_values(bf16)) <= mxfp4.E4M3_MAX * np.repeat(bf16.scales, 512, 1))


def test_scales_are_two_bytes_each_and_round_trip():
    s = np.random.default_rng(3).uniform(-1.0, 1.0, (14, 6)).astype(ml_dtypes.bfloat16).astype(np.float32)
    stored = pack_bf16_scales(s)
    assert stored.shape == (28, 6) and stored.dtype == np.uint8
    assert np.array_equal(unpack_bf16_scales(stored), s)
    fmt = WeightFormat("fp4", 512, rounded=True, scale="bf16")
    assert tensors("down", 7168, 6, fmt)["down_scales"].shape == stored.shape


def _in_kernel(fn, args, out_shape):
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)

    def body(*refs):
        refs[-1][...] = fn(*[r[...] for r in refs[:-1]])
    return np.asarray(pl.pallas_call(body, out_shape=out_shape, in_specs=[vmem] * len(args),
                                     out_specs=vmem, interpret=pltpu.InterpretParams())(*args))


def test_the_kernel_decodes_the_stored_scales_exactly():
    s = np.random.default_rng(4).uniform(-2, 2, (20, 256)).astype(ml_dtypes.bfloat16).astype(np.float32)
    got = _in_kernel(ops.bf16_block_scales, [pack_bf16_scales(s)],
                     jax.ShapeDtypeStruct((20, 256), F32))
    assert np.array_equal(got, s)


@pytest.mark.parametrize("batch", [1, 8])
def test_the_kernel_s_fp4_group_dots_equal_the_emulation_bit_for_bit(batch):
    """Per pack group, a mixed bf16 x fp4 dot of the codes times the group's block scale, added
    in order, is the emulation's `chunked_linear` of the codes' values with the scales per group;
    with the scales of two blocks swapped it is not."""
    n_out, n_in, group, block = 256, 2048, 256, 512
    codes, scales = _spread_mxfp4((n_out, n_in), 2, 5)
    r = mxfp4.requantize_blocks(codes, scales, block, "bf16")
    packed, stored = np.ascontiguousarray(r.codes.T), pack_bf16_scales(r.scales.T)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((batch, n_in)), jnp.bfloat16)

    def fn(x, c, s):
        decoded = ops.bf16_block_scales(s)
        parts = [ops.fp4_group_matmul(x[:, g * group:(g + 1) * group],
                                      c[g * group // 2:(g + 1) * group // 2],
                                      decoded[g * group // block:g * group // block + 1])
                 for g in range(n_in // group)]
        return sum(parts[1:], parts[0])

    got = _in_kernel(fn, [x, jnp.asarray(packed), jnp.asarray(stored)],
                     jax.ShapeDtypeStruct((batch, n_out), F32))
    w = jnp.asarray(mxfp4.mxfp4_dequantize(r.codes, np.full((n_out, n_in // 32), 127, np.uint8),
                                           (n_out, n_in)))
    per_group = jnp.asarray(np.repeat(r.scales, block // group, axis=1).T)
    np.testing.assert_array_equal(got, np.asarray(chunked_linear(x, w, group, "mixed_fp4", per_group)))
    assert not np.array_equal(got, np.asarray(chunked_linear(x, w, group, "mixed_fp4", per_group[::-1])))


def test_k3_a_requantized_checkpoint_packs_to_what_the_checkpoint_packs_to():
    from mkc.families.kimi_k3 import reference
    from mkc.families.kimi_k3 import weights as kw
    from mkc.families.kimi_k3.config import KimiDims
    from mkc.layers.moe.weights import PACKED_BLOCK_SCALE as BLOCK_SCALE
    d = KimiDims.load(CONFIG_DIR / "kimi_k3_mini.json")
    rules = {"heads": (16, 1), "mlp": (16, 1), "vocab": (16, 1), "latent_down": (16, 1),
             "experts": (4, 4), "expert_mlp": (4, 1), "latent_up": (8, 1), "router": (2, 1)}
    hf = reference.init_params(reference.load_config(CONFIG_DIR / "kimi_k3_mini.json"), seed=3)
    formats = {"expert.gate_up": WeightFormat("fp4", 512, rounded=True, scale="bf16"),
               "expert.down": WeightFormat("fp4", 128, rounded=True, scale="bf16")}
    held, report = kw.requantization(hf, d, formats, ShardTable.of(rules, 16), layers=[2])
    e5 = "model.layers.2.block_sparse_moe.experts.5."
    assert held[e5 + "w2." + BLOCK_SCALE].dtype == np.float32 and (held[e5 + "w2.weight_scale"] == 127).all()
    assert report["expert.gate_up"]["format"] == "fp4 block 256 rounded scale bf16"
    for rank in (1, 6):
        a = kw.expert_arrays(hf, d, 2, 5, rank, 4, formats)
        b = kw.expert_arrays({**hf, **held}, d, 2, 5, rank, 4, formats)
        assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
    e8m0 = {c: dataclasses.replace(f, scale="e8m0") for c, f in formats.items()}
    with pytest.raises(ValueError, match="pack the checkpoint itself"):
        kw.expert_arrays({**hf, **held}, d, 2, 5, 1, 4, e8m0)


def test_moe_a_requantized_checkpoint_packs_to_what_the_checkpoint_packs_to():
    from mkc.families.qwen3_5_moe import reference, weights
    from mkc.families.qwen3_5_moe.config import read_dims
    from mkc.layers.moe import BLOCK_SCALE
    config = json.loads((CONFIG_DIR / "qwen3_5_moe_mini.json").read_text())
    hf = reference.init_params(reference.load_config(config), seed=0)
    d = read_dims(config, "qwen3_5_moe_mini")
    formats = {"expert.gate_up": WeightFormat("fp8", 256, rounded=True, scale="bf16"),
               "expert.down": WeightFormat("fp8", 128, rounded=True, scale="bf16")}
    shards = ShardTable(ranks=8, rules=(("experts", 8, 1), ("heads", 8, 1), ("mlp", 8, 1),
                                        ("vocab", 8, 1)))
    held, report = weights.requantization(hf, d, formats, shards, layers=[1])
    name = "model.layers.1.mlp.experts.down_proj"
    assert held[name + BLOCK_SCALE].shape == (d.experts, d.hidden_size, d.moe_intermediate_size // 128)
    assert report["expert.down"]["format"] == "fp8 block 128 rounded scale bf16"
    a = weights.expert(hf, d, {}, 3, 1, 3, shards, formats)
    b = weights.expert({**hf, **held}, d, {}, 3, 1, 3, shards, formats)
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)

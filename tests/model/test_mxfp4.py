"""MXFP4 codec: the e2m1 code table, nibble and scale layout, rounding, exact round trips, and
the in-graph decoder against the numpy one."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkc.model.mxfp4 import (E2M1_VALUES, mxfp4_dequantize, mxfp4_dequantize_jax,
                             mxfp4_quantize)

POSITIVE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_code_table_nibble_order_and_scales() -> None:
    # Codes 0..15 twice over two blocks; byte j holds element 2j low, 2j + 1 high.
    codes = np.array([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 4], np.uint8)
    scales = np.array([[127, 129]], np.uint8)  # 2**0 and 2**2
    got = mxfp4_dequantize(codes, scales, (1, 64))
    table = np.array(POSITIVE + [-v for v in POSITIVE], np.float32)
    want = np.concatenate([np.tile(table, 2), 4 * np.tile(table, 2)])
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(E2M1_VALUES, table)
    extremes = mxfp4_dequantize(codes, np.array([[1, 254]], np.uint8), (1, 64))[0]
    assert extremes[1] == np.float32(2.0 ** -127) and extremes[32 + 3] == np.float32(1.5 * 2.0 ** 127)


def test_known_values_encode_to_known_codes() -> None:
    # Block max 6 * 2**-3 fixes scale 124; -0.375 = -3 * 2**-3 is code 8 | 5.
    w = np.zeros((1, 32), np.float32)
    w[0, :4] = [0.75, -0.375, 0.0625, 0.0]
    codes, scales = mxfp4_quantize(w)
    assert scales.tolist() == [[124]]
    assert codes[0, :2].tolist() == [0x7 | (0xD << 4), 0x1]
    assert not codes[0, 2:].any()
    # A block of 4s keeps scale 2**0 (4 fits under 6); 6.5 needs 2**1 and 6.5 / 2 rounds to 3.
    assert mxfp4_quantize(np.full(32, 4.0))[1].tolist() == [127]
    one = np.zeros(32)
    one[0] = 6.5
    c, s = mxfp4_quantize(one)
    assert s.tolist() == [128] and mxfp4_dequantize(c, s, (32,))[0] == 6.0


def test_midpoints_round_to_the_even_code() -> None:
    w = np.zeros(32)
    w[:9] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -5.0]  # 6 pins the scale at 2**0
    codes, scales = mxfp4_quantize(w)
    assert scales.tolist() == [127]
    got = mxfp4_dequantize(codes, scales, (32,))[:9]
    np.testing.assert_array_equal(got, [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -4.0])


def test_representable_values_round_trip_exactly() -> None:
    rng = np.random.default_rng(0)
    shape = (4, 6, 128)
    codes = rng.integers(0, 256, (4, 6, 64), dtype=np.uint8)
    scales = rng.integers(100, 160, (4, 6, 4), dtype=np.uint8)
    values = mxfp4_dequantize(codes, scales, shape)
    again = mxfp4_dequantize(*mxfp4_quantize(values), shape)
    np.testing.assert_array_equal(again, values)

    # Canonical blocks (a magnitude-4 or -6 code in every block, no -0) keep codes and scales.
    nibbles = rng.integers(0, 16, shape)
    nibbles[nibbles == 8] = 0
    nibbles[..., ::32] = rng.choice([6, 7, 14, 15], nibbles[..., ::32].shape)
    packed = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
    re_codes, re_scales = mxfp4_quantize(mxfp4_dequantize(packed, scales, shape))
    np.testing.assert_array_equal(re_codes, packed)
    np.testing.assert_array_equal(re_scales, scales)


def test_gaussian_error_is_within_half_a_step_and_scales_are_minimal() -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(size=(16, 256)) * np.exp(rng.uniform(-20, 20, (16, 1)))
    codes, scales = mxfp4_quantize(w)
    got = mxfp4_dequantize(codes, scales, w.shape).astype(np.float64)
    step = np.repeat(np.ldexp(1.0, scales.astype(int) - 127), 32, axis=-1)
    # The widest e2m1 gap is 2 (between 4 and 6): rounding moves a value by at most 1 step.
    assert np.all(np.abs(got - w) <= step * (1 + 1e-6))
    amax = np.abs(w).reshape(16, -1, 32).max(-1)
    scale = np.ldexp(1.0, scales.astype(int) - 127)
    assert np.all(amax <= 6 * scale) and np.all(amax > 3 * scale)  # a halved scale would overflow
    rel = np.sqrt(np.mean((got - w) ** 2, axis=-1) / np.mean(w ** 2, axis=-1))
    assert np.all(rel < 0.2), rel


def test_zero_and_tiny_blocks() -> None:
    codes, scales = mxfp4_quantize(np.zeros((2, 32), np.float32))
    assert not codes.any() and scales.tolist() == [[127], [127]]
    tiny = np.full(32, 1e-45, np.float64)  # below 6 * 2**-127: the scale clamps at its minimum
    codes, scales = mxfp4_quantize(tiny)
    assert scales.tolist() == [1] and not codes.any()


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        mxfp4_quantize(np.full(32, np.nan))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(np.zeros((2, 48)))
    with pytest.raises(ValueError, match="needs codes"):
        mxfp4_dequantize(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8), (2, 64))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_dequantize(np.zeros((2, 16), np.int32), np.zeros((2, 1), np.uint8), (2, 32))


def test_jax_decoder_matches_numpy_bitwise() -> None:
    rng = np.random.default_rng(2)
    shape = (3, 5, 96)
    codes = rng.integers(0, 256, (3, 5, 48), dtype=np.uint8)
    scales = rng.integers(90, 170, (3, 5, 3), dtype=np.uint8)
    scales[0, 0, 0] = 255  # NaN scale
    want = mxfp4_dequantize(codes, scales, shape)
    got = jax.jit(mxfp4_dequantize_jax, static_argnums=2)(jnp.asarray(codes), jnp.asarray(scales), shape)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), want)  # NaNs compare equal here
    assert np.all(np.isnan(want[0, 0, :32])) and not np.any(np.isnan(want[0, 0, 32:]))

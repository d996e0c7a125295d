"""The `int4 block N` and `nvfp4` routed-expert formats (`mkc.layers.expert_formats`): their
kernel decodes in Pallas interpret mode against numpy decodes (bit for bit), the lowered expert
matmul against the rounding emulation (`expert_formats.reference`, bit for bit) and against f64
products of the values, the host packers' round trips, the requantizer's error and refusal, the
format rules' diagnostics, and 1 % mutants of each decode rejected by these checks."""
from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc.ir import WeightFormat
from mkc.layers import expert_formats
from mkc.layers.expert_formats import ops, reference, weights
from mkc.model.family import FormatError
from mkc.reference.rounding import Rounding
from layer_bodies import lowered_expert_matmul

N_OUT, N_IN = 256, 512
VMEM = pl.BlockSpec(memory_space=pltpu.VMEM)


def _kernel(body, out_shape, *args) -> np.ndarray:
    call = pl.pallas_call(body, out_shape=out_shape, in_specs=[VMEM] * len(args), out_specs=VMEM,
                          interpret=pltpu.InterpretParams())
    return np.asarray(call(*(jnp.asarray(a) for a in args)))


def _x(seed: int, rows: int = 3) -> np.ndarray:
    x = np.random.default_rng(seed).normal(0, 1, (rows, N_IN))
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _int4(seed: int = 1, block: int = 128) -> weights.Int4:
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.02, (N_OUT, N_IN)) * rng.uniform(0.2, 5, (N_OUT, 1))
    return weights.int4_quantize(w.astype(ml_dtypes.bfloat16).astype(np.float32), block)


def _nvfp4(seed: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A checkpoint matrix as NVFP4 stores it: codes [out, in/2], e4m3 scales [out, in/16]
    (every positive normal one: bytes 0x08 to 0x7E), a global scale a row (gate's and up's
    halves differ)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (N_OUT, N_IN // 2), dtype=np.uint8)
    scale = rng.choice(np.arange(0x08, 0x7F, dtype=np.uint8), (N_OUT, N_IN // 16))
    glob = np.where(np.arange(N_OUT) < N_OUT // 2, np.float32(3.1e-4), np.float32(7.7e-5))
    return codes, scale.view(ml_dtypes.float8_e4m3fn), glob


def _exact(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and bool(np.array_equal(got.view(np.uint32), want.view(np.uint32)))


# ---- decodes, bit for bit against numpy ------------------------------------------------------
def _int4_decoded(codes: np.ndarray) -> np.ndarray:
    def body(c_ref, o_ref):
        o_ref[...] = pltpu.bitcast(c_ref[...], jnp.int4).astype(jnp.float32)
    return _kernel(body, jax.ShapeDtypeStruct((2 * codes.shape[0], codes.shape[1]), jnp.float32), codes)


def _nvfp4_decoded(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    def body(c_ref, s_ref, o_ref):
        blocks = c_ref.shape[0] * 2 // expert_formats.NVFP4_BLOCK
        o_ref[...] = (ops.nvfp4_values(c_ref[...], s_ref[:blocks]).astype(jnp.float32)
                      * ops.nvfp4_global_scale(s_ref[blocks:]))
    return _kernel(body, jax.ShapeDtypeStruct((2 * codes.shape[0], codes.shape[1]), jnp.float32),
                   codes, scales)


def test_int4_codes_decode_bit_exact():
    r = _int4()
    codes, scales = weights.pack_int4_for_kernel(r.codes, r.scales)
    got = _int4_decoded(codes)
    assert np.array_equal(got, r.codes.T.astype(np.float32))


def test_nvfp4_decode_bit_exact():
    codes, scale, glob = _nvfp4()
    packed, packed_scales = weights.pack_nvfp4_for_kernel(codes, scale, glob)
    want = weights.nvfp4_dequantize(packed, packed_scales).astype(np.float32)   # f32 x f32: one rounding
    assert _exact(_nvfp4_decoded(packed, packed_scales), want)


# ---- the lowered expert matmul: emulation bit for bit, f64 within 1e-5 ----------------------
def _int4_case(group: int, block: int = 128, seed: int = 3):
    r = _int4(seed, block)
    codes, scales = weights.pack_int4_for_kernel(r.codes, r.scales)
    fmt = WeightFormat("int4", block=block, rounded=True)
    return r, codes, scales, fmt, _x(seed + 1)


@pytest.mark.parametrize("group, block", [(512, 128), (128, 128), (256, 512)])
def test_int4_matmul_equals_emulation_and_values(group, block):
    r, codes, scales, fmt, x = _int4_case(group, block)
    got = lowered_expert_matmul(fmt, codes, scales, x, group)
    emulated = np.asarray(reference.int4_linear(Rounding(1, ()), jnp.asarray(x), r.codes, r.scales,
                                                block, group))
    assert _exact(got, emulated)
    want = x.astype(np.float64) @ weights.int4_dequantize(codes, scales)
    assert np.max(np.abs(got - want)) < 1e-5 * np.max(np.abs(want))


@pytest.mark.parametrize("group, rows", [(512, 8), (128, 3), (512, 1), (128, 2)])
def test_nvfp4_matmul_equals_emulation_and_values(group, rows):
    """Values decoded (3 and 8 rows) and codes fed as a block-diagonal dot (1 and 2 rows)."""
    codes, scale, glob = _nvfp4(5)
    packed, packed_scales = weights.pack_nvfp4_for_kernel(codes, scale, glob)
    x = _x(6, rows)
    got = lowered_expert_matmul(WeightFormat("nvfp4", block=16), packed, packed_scales, x, group)
    emulated = np.asarray(reference.nvfp4_linear(Rounding(1, ()), jnp.asarray(x), packed, packed_scales,
                                                 group))
    assert _exact(got, emulated)
    want = x.astype(np.float64) @ weights.nvfp4_dequantize(packed, packed_scales)
    assert np.max(np.abs(got - want)) < 1e-5 * np.max(np.abs(want))


def test_operands_are_bf16_dots():
    r = Rounding(1, (), formats=(("expert.gate_up", WeightFormat("int4", 128, rounded=True)),
                                 ("expert.down", WeightFormat("nvfp4", 16))))
    assert reference.expert_operands(r, "gate_up") == reference.expert_operands(r, "down") == "bf16"


# ---- 1 % mutants of each decode are rejected -------------------------------------------------
def test_one_percent_mutants_of_the_decodes_fail():
    n_codes, n_scale, glob = _nvfp4()
    packed, packed_scales = weights.pack_nvfp4_for_kernel(n_codes, n_scale, glob)
    want = weights.nvfp4_dequantize(packed, packed_scales).astype(np.float32)
    real_values, real_global = ops.nvfp4_values, ops.nvfp4_global_scale
    for name, mutant in (("nvfp4_values", lambda c, s: real_values(c, s) * 1.01),
                         ("nvfp4_global_scale", lambda s: real_global(s) * 1.01)):
        with mock.patch.object(ops, name, mutant):
            assert not _exact(_nvfp4_decoded(packed, packed_scales), want), name
    # the lowered nvfp4 matmul at one row (the codes' block-diagonal dot) against f64 values
    x = _x(11, rows=1)
    want = x.astype(np.float64) @ weights.nvfp4_dequantize(packed, packed_scales)
    real_codes = ops.nvfp4_codes_matmul
    with mock.patch.object(ops, "nvfp4_codes_matmul", lambda x, c, s: real_codes(x, c, s) * 1.01):
        got = lowered_expert_matmul(WeightFormat("nvfp4", 16), packed, packed_scales, x, 128)
    assert np.max(np.abs(got - want)) > 1e-3 * np.max(np.abs(want))
    # the lowered int4 matmul against the emulation: a block's scale or its dot 1 % off
    r, codes, scales, fmt, x = _int4_case(512)
    emulated = np.asarray(reference.int4_linear(Rounding(1, ()), jnp.asarray(x), r.codes, r.scales, 128, 512))
    real_scales, real_dot = ops.bf16_block_scales, ops.int4_dot
    for name, mutant in (("bf16_block_scales", lambda s: real_scales(s) * 1.01),
                         ("int4_dot", lambda x, c: real_dot(x, c) * 1.01)):
        with mock.patch.object(ops, name, mutant):
            assert not _exact(lowered_expert_matmul(fmt, codes, scales, x, 512), emulated), name


# ---- packing ---------------------------------------------------------------------------------
def test_int4_packing_round_trips():
    r = _int4(7)
    codes, scales = weights.pack_int4_for_kernel(r.codes, r.scales)
    assert codes.shape == (N_IN // 2, N_OUT) and scales.shape == (2 * N_IN // 128, N_OUT)
    q, s = weights.unpack_int4_from_kernel(codes, scales)
    assert np.array_equal(q, r.codes) and np.array_equal(s, r.scales)
    assert np.array_equal(weights.int4_dequantize(codes, scales).T, r.held())


def test_nvfp4_packing_round_trips_byte_for_byte():
    codes, scale, glob = _nvfp4(8)
    packed, packed_scales = weights.pack_nvfp4_for_kernel(codes, scale, glob)
    tensors = expert_formats.tensors("gate_up", N_IN, N_OUT, WeightFormat("nvfp4", 16))
    assert packed.shape == tensors["gate_up_codes"].shape
    assert packed_scales.shape == tensors["gate_up_scales"].shape
    c, s, g = weights.unpack_nvfp4_from_kernel(packed, packed_scales)
    assert np.array_equal(c, codes) and np.array_equal(s, scale.view(np.uint8))
    assert np.array_equal(g, glob)


def test_int4_requantizes_exactly_where_values_fit_and_reports_its_error():
    r = _int4(9)
    again = weights.int4_quantize(r.held(), 128)           # held values fit: nothing moves
    assert again.exact and np.array_equal(again.held(), r.held())
    assert np.array_equal(weights.int4_from_bf16(r.held(), WeightFormat("int4", 128), "expert.down",
                                                 "expert 0's down").codes, again.codes)
    rng = np.random.default_rng(10)
    w = rng.normal(0, 1, (N_OUT, N_IN)).astype(ml_dtypes.bfloat16).astype(np.float32)
    with pytest.raises(FormatError, match="no int4 code") as e:
        weights.int4_from_bf16(w, WeightFormat("int4", 128), "expert.down", "expert 0's down")
    assert "int4 block 128 rounded" in e.value.hint
    lossy = weights.int4_from_bf16(w, WeightFormat("int4", 128, rounded=True), "expert.down", "x")
    step = np.repeat(lossy.scales, 128, axis=1)
    assert (np.abs(lossy.held() - w) <= step / 2 + 1e-6 * step).all()
    assert 0.05 < np.sqrt(lossy.sq_err / lossy.sq_ref) < 0.15        # relative RMS of Gaussian draws


@pytest.mark.parametrize("args, message", [
    (dict(codes=np.zeros((4, 8), np.uint8), block_scales=np.zeros((4, 2), np.uint8), global_scale=1.0),
     "do not match"),
    (dict(codes=np.zeros((4, 8), np.uint8), block_scales=np.full((4, 1), 0x7F, np.uint8), global_scale=1.0),
     r"4 e4m3 block scale\(s\) outside 0.01562 to 448 .*the first \(nan\) at index \[0, 0\]"),
    (dict(codes=np.zeros((4, 8), np.uint8), block_scales=np.full((4, 1), 0x38, np.uint8),
          global_scale=np.array([1, 1, -1, 1], np.float32)),
     r"weight_scale_2 \[out\]: 1 global scale\(s\) outside .* at index \[2\]"),
    (dict(codes=np.zeros((4, 8), np.uint8), block_scales=np.full((4, 1), 0x38, np.uint8), global_scale=0.0),
     "global scale"),
    (dict(codes=np.zeros((4, 8), np.uint8), block_scales=np.full((4, 1), 0x38, np.uint8), global_scale=1e30),
     "global scale"),
    # a subnormal, zero or negative e4m3 scale
    *[(dict(codes=np.zeros((4, 8), np.uint8), block_scales=np.full((4, 1), b, np.uint8), global_scale=1.0),
       "e4m3 block scale") for b in (0x01, 0x00, 0x80, 0xB8)],
])
def test_nvfp4_packing_refuses(args, message):
    with pytest.raises(ValueError, match=message):
        weights.pack_nvfp4_for_kernel(**args)


def test_int4_packing_refuses():
    with pytest.raises(ValueError, match="-8..7"):
        weights.pack_int4_for_kernel(np.full((2, 128), 9, np.int8), np.ones((2, 1), np.float32))
    with pytest.raises(ValueError, match="whole blocks"):
        weights.pack_int4_for_kernel(np.zeros((2, 128), np.int8), np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="bf16"):
        weights.pack_int4_for_kernel(np.zeros((2, 128), np.int8), np.full((2, 1), 1.001, np.float32))
    # 0, a negative, a subnormal, NaN, and one under which -8 overflows bf16
    for bad in (0.0, -1.0, 1e-39, np.nan, 3e38):
        with pytest.raises(ValueError, match=r"1 int4 block scale\(s\) outside .* at index \[1, 0\]"):
            weights.pack_int4_for_kernel(np.zeros((2, 128), np.int8), np.array([[1.0], [bad]], np.float32))


def test_int4_scales_stay_in_their_range():
    """A block of values under bf16's smallest normal over 7, or past its largest over 8, takes
    the range's end as its scale (its values moved, not a scale the packer refuses)."""
    w = np.zeros((3, 128), np.float32)
    w[0, :2] = 1e-39, -3e-39                        # subnormal over 7
    w[1, :2] = 3.3e38, -1.0                         # past bf16 max / 8 over 7
    w[2, :2] = 0.5, 1.0
    r = weights.int4_quantize(w, 128)
    assert not weights.INT4_SCALES.outside(r.scales).any()
    assert r.scales[0, 0] == weights.INT4_SCALES.low and r.scales[1, 0] == weights.INT4_SCALES.high
    assert r.changed > 0 and np.isfinite(r.held()).all()
    weights.pack_int4_for_kernel(r.codes, r.scales)


def test_nvidias_quantizer_writes_scales_the_loader_admits():
    """A block of zeros takes scale 1 (as ModelOpt writes it), a block 10^6 times under the
    matrix's largest value e4m3's smallest normal (not a subnormal or 0), and a matrix past
    what a global scale may hold the range's end: each packs, the moved values counted."""
    from mkc.model import nvfp4
    w = np.zeros((3, 32), np.float32)
    w[0, :16] = np.linspace(-1, 1, 16)
    w[1, :16] = 1e-6                                # w[1, 16:] a block of zeros
    r = weights.nvfp4_from_bf16(w)
    scales = r.block_scales.astype(np.float32)
    assert scales[1, 1] == 1 and scales[1, 0] == nvfp4.BLOCK_SCALES.low
    assert not nvfp4.BLOCK_SCALES.outside(r.block_scales).any() and r.changed > 0
    r.held()                                         # packs
    huge = weights.nvfp4_from_bf16(np.full((1, 16), 1e30, np.float32))
    assert huge.global_scale == np.float32(nvfp4.GLOBAL_SCALES.high) and huge.changed == 16
    with pytest.raises(ValueError, match="global scale"):
        weights.nvfp4_from_bf16(w, np.float32(0))
    with pytest.raises(ValueError, match="does not tile"):
        weights.int4_quantize(np.zeros((2, 100)), 128)


# ---- the format rules ------------------------------------------------------------------------
BF16_CLASSES = (("expert.gate_up", ("bf16", "fp8", "int4")), ("expert.down", ("bf16", "fp8", "int4")))
NVFP4_CLASSES = (("expert.gate_up", ("nvfp4",)), ("expert.down", ("nvfp4",)))
ROWS, GROUPS = {"gate_up": 4096, "down": 512}, {"gate_up": 512, "down": 128}


def test_formats_resolve():
    got = expert_formats.resolve(BF16_CLASSES, ROWS, GROUPS, {
        "expert.gate_up": WeightFormat("int4", 128, rounded=True),
        "expert.down": WeightFormat("int4", 0, rounded=True)})
    assert got["expert.gate_up"].block == got["expert.down"].block == 128
    got = expert_formats.resolve(NVFP4_CLASSES, ROWS, GROUPS)
    assert got["expert.gate_up"] == WeightFormat("nvfp4", 16)
    t = expert_formats.tensors("down", 512, 4096, WeightFormat("int4", 128, rounded=True))
    assert t["down_codes"].shape == (256, 4096) and t["down_scales"].shape == (8, 4096)


@pytest.mark.parametrize("classes, fmt, message", [
    (BF16_CLASSES, WeightFormat("int4", 96, rounded=True), "does not tile"),
    (BF16_CLASSES, WeightFormat("int4", 192, rounded=True), "does not tile"),
    (BF16_CLASSES, WeightFormat("nvfp4"), "is bf16"),
    (NVFP4_CLASSES, WeightFormat("nvfp4", 32), "no other block"),
    (NVFP4_CLASSES, WeightFormat("nvfp4", 16, rounded=True), "nothing to round"),
    (NVFP4_CLASSES, WeightFormat("int4", 128, rounded=True), "would requantize"),
    ((("expert.gate_up", ("mxfp4", "int4")), ("expert.down", ("mxfp4",))),
     WeightFormat("int4", 128, rounded=True), "is mxfp4"),
])
def test_format_refusals_name_what_fits(classes, fmt, message):
    with pytest.raises(FormatError, match=message) as e:
        expert_formats.resolve(classes, ROWS, GROUPS, {"expert.down": fmt})
    assert e.value.hint and "format expert.down" in e.value.hint or "drop" in e.value.hint


def test_nvfp4_refuses_rows_past_whole_pack_groups():
    with pytest.raises(FormatError, match="whole pack"):
        expert_formats.resolve(NVFP4_CLASSES, {"gate_up": 4096, "down": 96}, {"gate_up": 512, "down": 96})


def test_nvfp4_checkpoint_layout_offers_its_own_format():
    from mkc.layers.moe.options import Checkpoint
    t = Checkpoint.NVFP4.expert_tensors("experts.", 4, 256, 512)
    assert t["experts.gate_up_proj"] == ((4, 512, 256), "uint8")
    assert t["experts.down_proj_weight_scale"] == ((4, 512, 16), "float8_e4m3fn")
    assert t["experts.gate_up_proj_weight_scale_2"] == t["experts.down_proj_input_scale"] == ((4,), "float32")
    got = expert_formats.resolve(Checkpoint.NVFP4.formats, ROWS, GROUPS)
    assert {f.spelled for f in got.values()} == {"nvfp4 block 16"}


def test_retarget_keeps_nvfp4_which_has_no_fallback():
    from mkc.resolve.formats import FALLBACK, NATIVE
    assert NATIVE["nvfp4"] == "fp4_operand" and "nvfp4" not in FALLBACK


def test_a_ranks_slice_is_the_whole_matrix_cut():
    """Two ranks' slices of a checkpoint matrix (down: input columns split; gate|up: a rank's
    gate and up rows) as their slots hold them equal the whole matrix's slot cut the same way."""
    codes, scale, glob = _nvfp4(12)
    whole_c, whole_s = weights.pack_nvfp4_for_kernel(codes, scale, glob)
    values = weights.nvfp4_dequantize(whole_c, whole_s)                       # [in, out]
    half = N_IN // 2
    for rank in (0, 1):
        cols = list(range(rank * half, (rank + 1) * half))
        rows = list(range(0, 32)) + list(range(128, 160))                   # gate and up rows
        c, s = weights.nvfp4_expert_slice(codes, scale, glob, rows, cols)
        assert np.array_equal(weights.nvfp4_dequantize(c, s), values[np.ix_(cols, rows)])
    with pytest.raises(ValueError, match="whole runs"):
        weights.nvfp4_expert_slice(codes, scale, glob, [0], list(range(8, 24)))
    w = _int4(13).held()
    fmt = WeightFormat("int4", 128)
    c, s, r = weights.int4_expert_slice(w, range(64), range(256, 512), fmt, "expert.down", "expert 0")
    assert r.exact and np.array_equal(weights.int4_dequantize(c, s).T, w[:64, 256:])
    with pytest.raises(ValueError, match="whole 128-row blocks"):
        weights.int4_expert_slice(w, range(4), range(64, 192), fmt, "expert.down", "expert 0")

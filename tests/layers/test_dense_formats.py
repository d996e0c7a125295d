"""The dense classes' formats (`mkc.layers.dense_formats`): their rules; requantizing a
checkpoint row by row to 8-bit codes under a bf16 scale, whose held values give back their
codes and scales (as packing and the emulation read them); the checkpoint tensors a class
reads; and the per-class error report."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mkc.ir import WeightFormat
from mkc.layers import dense_formats
from mkc.model import channel_codes as dense
from mkc.model.family import FormatError


def test_rules_take_codes_with_a_scale_per_column_and_rounding_only():
    ok = WeightFormat("int8", channel=True, rounded=True)
    assert dense_formats.resolve("mlp", ok) == ok
    assert dense_formats.resolve("mlp", WeightFormat("bf16")) == WeightFormat("bf16")
    for fmt, said in ((WeightFormat("fp8", rounded=True), "say so with `channel`"),
                      (WeightFormat("fp8", channel=True), "must accept the rounding"),
                      (WeightFormat("int8", block=512, channel=True, rounded=True), "not per block"),
                      (WeightFormat("bf16", channel=True), "means nothing")):
        with pytest.raises(FormatError, match=said):
            dense_formats.resolve("attention", fmt)
    assert WeightFormat("fp8", channel=True, rounded=True).spelled == "fp8 channel rounded"


@pytest.mark.parametrize("codes", ["fp8", "int8"])
def test_requantized_rows_give_back_their_codes_and_scales(codes):
    """Each row's scale is a bf16 value, its largest code the code's largest, its values codes x
    scale exactly in f32; the emulation's `channel_codes` reads the same codes and scales back
    from the held values, and requantizing them again changes nothing."""
    from mkc.reference.rounding import channel_codes
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(64, 300)) * rng.lognormal(0, 2, size=(64, 1))).astype(ml_dtypes.bfloat16)
    w = w.astype(np.float32)
    w[5] = 0.0                                            # an all-zero row: scale 0, codes 0
    held, scale, r = dense.requantize(w, codes)
    assert (scale.astype(ml_dtypes.bfloat16).astype(np.float32) == scale).all()
    values = dense.quantize(held, scale, codes)
    assert np.array_equal(values * scale[:, None], held.astype(np.float64))
    top = np.abs(values).max(axis=1)
    assert (top[scale > 0] == dense.QMAX[codes]).all() and scale[5] == 0
    back, back_scale = (np.asarray(a) for a in channel_codes(held, codes))
    np.testing.assert_array_equal(back, values)
    np.testing.assert_array_equal(back_scale, scale)
    again, again_scale, r2 = dense.requantize(held, codes)
    np.testing.assert_array_equal(again, held)
    assert r2.changed == 0 and r.changed > 0 and r.blocks == 64
    rms = (r.sq_err / r.sq_ref) ** 0.5
    assert rms < {"fp8": 0.04, "int8": 0.012}[codes], rms


@pytest.mark.parametrize("codes", ["fp8", "int8"])
def test_kernel_codes_are_the_held_values_over_their_column_scales(codes):
    w = np.random.default_rng(1).normal(size=(40, 96)).astype(np.float32)
    held, scale, _ = dense.requantize(w, codes)
    # a rank's matrix [in, out]: every column a checkpoint row (its scale down the column)
    stored, col = dense.kernel_codes(held.T, np.broadcast_to(scale, (96, 40)), codes, "m")
    as_values = stored.view(np.int8 if codes == "int8" else ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(as_values.astype(np.float64) * col, held.T.astype(np.float64))
    with pytest.raises(ValueError, match="vary down a column"):
        dense.kernel_codes(held, np.broadcast_to(scale[:, None], (40, 96)), codes, "m")


def test_lazy_rows_are_requantized_as_the_whole_tensor():
    """`Channel` requantizes only the rows an index keeps, the same as the whole tensor; an
    index into the inputs reads the whole tensor (a row's scale needs all of its inputs)."""
    w = np.random.default_rng(2).normal(size=(32, 64)).astype(np.float32)
    whole, scale, _ = dense.requantize(w, "int8")
    lazy = dense.Channel(w, "int8")
    np.testing.assert_array_equal(lazy[8:16], whole[8:16])
    np.testing.assert_array_equal(lazy[(slice(None), slice(0, 8))], whole[:, :8])
    np.testing.assert_array_equal(np.asarray(lazy), whole)
    np.testing.assert_array_equal(dense.Channel(w, "int8", "scales")[(slice(None), slice(3, 5))],
                                  np.broadcast_to(scale[:, None], (32, 2)))


class _Layout:
    """A family's `weights.matrix` whose matrices read `tensors` (a matrix -> tensor names)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def matrix(self, hf, dims, per_rank, layer, kind, name, rank, shards):
        return np.concatenate([np.asarray(hf[t]).T for t in self.tensors[name]], axis=1)


def test_sources_are_the_tensors_a_class_reads_and_one_tensor_holds_one_format():
    hf = {n: np.ones((4, 8), np.float32) for n in ("a", "b", "c")}
    M = dense.Member
    layout = _Layout({"qkv": ("a", "b"), "o": ("c",), "other": ("b",)})
    found = dense.sources(layout, hf, None, None, None,
                          [M(0, "gqa", "qkv", "int8", "attention"), M(0, "gqa", "o")])
    assert {n: m.name for n, m in found.items()} == {"a": "qkv", "b": "qkv"}
    with pytest.raises(FormatError, match="one tensor holds one format"):
        dense.sources(layout, hf, None, None, None,
                      [M(0, "gqa", "qkv", "int8", "attention"), M(0, "moe", "other")])


def test_the_report_is_per_class():
    rng = np.random.default_rng(3)
    hf = {"q": rng.normal(size=(16, 32)).astype(np.float32),
          "up": rng.normal(size=(8, 32)).astype(np.float32)}
    tensors = {"q": dense.Member(0, "gqa", "qkv", "fp8", "attention"),
               "up": dense.Member(0, "gqa", "gate_up", "fp8", "mlp")}
    fmt = WeightFormat("fp8", channel=True, rounded=True)
    held, report = dense.requantization(hf, tensors, {"attention": fmt, "mlp": fmt})
    assert set(held) == {"q", "up"} and held["q"].dtype == np.float32
    assert report["mlp"]["format"] == "fp8 channel rounded"
    assert report["attention"]["values"] == 16 * 32 and report["attention"]["blocks"] == 16
    assert 0 < report["mlp"]["relative_rms_error"] < 0.05


def test_a_spec_s_dense_classes_stream_as_codes_at_half_the_bytes():
    """Qwen 27B's attention, MLP and lm_head as FP8 codes (`tests_support.dense_text`): every
    streamed family is codes, each column block's last tile carries its scale rows, the stream
    moves about half the bytes, the spec passes every check (the trace copies and waits each
    tile at its own size), and reads of the codes are priced one value a byte."""
    from mkc import compiler, ir
    from mkc.trace import StepTracer, TraceOptions
    from tests_support import SPEC, dense_text
    bf16 = compiler.check_spec(SPEC).ir
    s = compiler.check_source(dense_text(SPEC, "fp8"), str(SPEC)).ir
    families = [f for fs in (*s.stream.families.values(), s.stream.tail) for f in fs]
    assert {f.codes for f in families} == {"fp8"}
    assert {f.format_class for f in families} == {"attention", "mlp", "lm_head"}
    f = s.stream.families["gdn"][0]
    assert f.bytes_of(f.row_tiles - 1) - f.bytes_of(0) == ir.SCALE_ROWS * f.tile_cols * 2
    assert 0.49 < s.stream.streamed_bytes / bf16.stream.streamed_bytes < 0.53
    assert s.matrix_facts["gdn.in_proj"].values_per_byte == 1.0
    assert s.matrix_facts["tail.lm_head"].values_per_byte == 1.0
    assert s.weight_formats["mlp"].spelled == "fp8 channel rounded"
    tracer = StepTracer(s, TraceOptions(whole_runs=True))
    assert sum(tracer.tile_bytes) == s.stream.streamed_bytes
    tile = tracer.ring_tile(f.row_tiles - 1)
    assert tile.weights("gdn", f.bytes_of(f.row_tiles - 1)) == (("gdn.in_proj", f.tile_bytes),)

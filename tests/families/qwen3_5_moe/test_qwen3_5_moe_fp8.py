"""Qwen3.5 MoE's FP8 routed experts (`format expert.gate_up fp8 block N rounded`): bf16 weights
requantized to e4m3 codes under one power-of-two scale per block of whole pack groups, the
error reported per matrix class; refused without `rounded` or with a block that does not tile
the pack groups, at the spec's `format` line; the packer's codes and scales hold exactly the
values `requantized_weights` gives the reference."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mkc.compiler import check_spec
from mkc.diagnostics import MkcError
from mkc.families.qwen3_5_moe import reference, weights
from mkc.families.qwen3_5_moe.config import read_dims
from mkc.ir import WeightFormat
from mkc.model.config import CONFIG_DIR
from mkc.model.mxfp4 import E4M3_MAX, fp8_block_values, requantize_fp8_blocks
from mkc.model.sharding import ShardTable
from tests_support import QWEN_MOE_SPEC as SPEC
from tests_support import format_text


def _spec(tmp_path: Path, gate_up: str, down: str = "fp8 block 128 rounded") -> Path:
    """The shipped spec (bf16 experts) with its format lines rewritten in place."""
    path = tmp_path / SPEC.name
    path.write_text(format_text(SPEC, (gate_up, down)))
    return path


def test_values_are_e4m3_codes_times_the_smallest_power_of_two_scale_holding_the_block():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 1024)) * np.exp2(rng.integers(-20, 20, (6, 1)))).astype(
        ml_dtypes.bfloat16).astype(np.float64)
    w[5, 512:] = 0.0                                   # an all-zero block
    r = requantize_fp8_blocks(w, 512)
    assert r.codes.shape == (6, 1024) and r.scales.shape == (6, 2)
    scale = np.exp2(r.scales.astype(np.int64) - 127.0)
    blocks = np.abs(w.reshape(6, 2, 512)).max(axis=-1)
    held = blocks > 0
    assert (blocks[held] <= E4M3_MAX * scale[held]).all()            # nothing overflows
    assert (blocks[held] > E4M3_MAX * scale[held] / 2).all()         # the smallest such scale
    codes = r.codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(6, 2, 512)
    values = fp8_block_values(r)
    assert np.array_equal(values, (codes * scale[..., None]).reshape(6, 1024))
    # every value is the nearest e4m3 value (times the scale) to the checkpoint's
    nearest = (w.reshape(6, 2, 512) / scale[..., None]).astype(np.float32).astype(
        ml_dtypes.float8_e4m3fn).astype(np.float64) * scale[..., None]
    assert np.array_equal(values, nearest.reshape(6, 1024))
    assert 0 < r.changed < r.values and r.max_abs == np.abs(values - w).max()
    assert 0 < (r.sq_err / r.sq_ref) ** 0.5 < 0.04                 # e4m3: 3 mantissa bits
    again = requantize_fp8_blocks(values, 512)                       # idempotent
    assert again.changed == 0 and np.array_equal(again.codes, r.codes)


def test_requantized_weights_are_what_the_packer_holds_and_the_error_is_reported():
    config = json.loads((CONFIG_DIR / "qwen3_5_moe_mini.json").read_text())
    cfg = reference.load_config(config)
    d = read_dims(config, "qwen3_5_moe_mini")
    hf = reference.init_params(cfg, seed=0)
    formats = {"expert.gate_up": WeightFormat("fp8", 256, rounded=True),
               "expert.down": WeightFormat("fp8", 128, rounded=True)}
    shards = ShardTable(ranks=8, rules=(("experts", 8, 1), ("heads", 8, 1), ("mlp", 8, 1),
                                        ("vocab", 8, 1)))
    changed, report = weights.requantization(hf, d, formats, shards, layers=[1])
    assert sorted(changed) == ["model.layers.1.mlp.experts.down_proj",
                               "model.layers.1.mlp.experts.gate_up_proj"]
    for cls in formats:
        r = report[cls]
        assert r["format"] == formats[cls].spelled and not r["exact"]
        assert 0 < r["changed"] <= r["values"] and 0 < r["relative_rms_error"] < 0.04
    # rank 3's local expert 1 (global expert 3 * 2 + 1) as the pool holds it, sublayer 3
    packed = weights.expert(hf, d, {}, 3, 1, 3, shards, formats)
    held = weights.expert(changed | {}, d, {}, 3, 1, 3, shards, {})      # bf16 of the held values
    for name, block in (("gate_up", 256), ("down", 128)):
        codes = packed[f"{name}_codes"].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        scale = np.exp2(np.repeat(packed[f"{name}_scales"].astype(np.int64) - 127.0, block, axis=0))
        assert np.array_equal(codes * scale, held[name].astype(np.float64))


@pytest.mark.parametrize("gate_up, message, hint", [
    ("fp8 block 512", "requantizing it to FP8 rounds", "fp8 block 512 rounded"),
    ("fp8 rounded", "one scale per block of whole pack groups", "fp8 block 512 rounded"),
    ("fp8 block 384 rounded", "does not tile expert.gate_up", "a multiple of 512"),
])
def test_bad_fp8_formats_are_located_diagnostics(tmp_path, gate_up, message, hint):
    path = _spec(tmp_path, gate_up)
    with pytest.raises(MkcError) as e:
        check_spec(path)
    [d] = e.value.diagnostics
    assert d.code == "E-FORMAT" and message in d.message and hint in d.hint, (d.message, d.hint)
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1)
                if t.strip().startswith("format expert.gate_up"))
    assert (d.span.file, d.span.line) == (str(path), line)


def test_the_shipped_spec_stores_the_checkpoint_s_bf16_and_fp8_is_a_variant(tmp_path):
    """Exact by default: the shipped spec keeps the checkpoint's bf16 experts; the rounded FP8
    blocks are the variant `format_text` writes, on the same lines."""
    shipped = check_spec(SPEC).ir.weight_formats
    assert {c: (f.name, f.rounded) for c, f in shipped.items()} == {
        "expert.gate_up": ("bf16", False), "expert.down": ("bf16", False)}
    fp8 = check_spec(_spec(tmp_path, "fp8 block 512 rounded")).ir.weight_formats
    assert {c: f.spelled for c, f in fp8.items()} == {
        "expert.gate_up": "fp8 block 512 rounded", "expert.down": "fp8 block 128 rounded"}
    assert {c: f.where for c, f in fp8.items()} == {c: f.where for c, f in shipped.items()}

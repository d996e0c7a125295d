"""benchmarks/block_scales.py: its float-scale quantizer agrees with mkc's own E8M0 requantization
where both apply, each scale holds its block, and the table docs/formats.md shows is what it
prints."""
from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import block_scales  # noqa: E402

from mkc.model import mxfp4  # noqa: E402

QWEN_DOWN = next(c for c in block_scales.CASES if c.source == "bf16" and c.block == 128)


def test_its_e8m0_scale_is_mkcs_fp8_requantization():
    w, _ = block_scales.draw(QWEN_DOWN, 0, np.random.default_rng(1))
    blocked = w.reshape(w.shape[0], -1, 128)
    s = block_scales._holding_scale(np.abs(blocked).max(axis=-1, keepdims=True), 448.0, "e8m0")
    mine = (np.clip(blocked / s, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            .astype(np.float64) * s).reshape(w.shape)
    assert np.array_equal(mine, mxfp4.fp8_block_values(mxfp4.requantize_fp8_blocks(w, 128)))


@pytest.mark.parametrize("scale", ["bf16", "f32"])
def test_a_float_scale_is_the_smallest_of_its_type_holding_the_block(scale):
    top = np.array([[1e-3], [0.37], [6.0], [448.0 * 3]])
    for largest in (6.0, 448.0):
        s = block_scales._holding_scale(top, largest, scale)
        assert np.all(s * largest >= top)
        dtype = ml_dtypes.bfloat16 if scale == "bf16" else np.float32
        below = (s.astype(dtype).view(np.uint16 if scale == "bf16" else np.uint32) - 1).view(dtype)
        assert np.all(below.astype(np.float64) * largest < top)


def test_the_searched_scale_is_never_worse_than_e8m0_and_each_rounds():
    results = block_scales.rows((0, 4), seed=0)
    assert {(r["spec"], r["matrix"]) for r in results} == {(c.spec, c.matrix) for c in block_scales.CASES}
    for r in results:
        e = r["error"]
        assert 0 < e["bf16 searched"] <= e["e8m0"], r
        assert r["bytes"]["e8m0"] < r["bytes"]["bf16"] < r["bytes"]["f32"]
    k3_spread = [r for r in results if r["spread"] == 4 and "block" in r["format"]]
    assert k3_spread and all(r["error"]["bf16 searched"] < 0.95 * r["error"]["e8m0"] for r in k3_spread)


def test_the_docs_show_the_printed_table():
    printed = block_scales.table(block_scales.rows((0, 2, 4), seed=0))
    assert printed in (ROOT / "docs" / "formats.md").read_text()

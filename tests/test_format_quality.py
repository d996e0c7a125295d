"""benchmarks/format_quality.py: the quality table of the rounding expert formats, as recorded and
as docs/formats.md shows it, its scale spread, and its whole path on a small run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import format_quality  # noqa: E402


def test_the_docs_table_is_the_recorded_one_and_every_rounded_format_has_rows():
    data = json.loads(format_quality.DATA.read_text())
    assert format_quality.table(data) in (ROOT / "docs" / "formats.md").read_text()
    specs = {r["spec"] for r in data["results"]}
    assert specs == {case.spec for case in format_quality.CASES.values()}
    assert data["steps"] >= 32
    for r in data["results"]:
        assert r["weight_error"] and all(e > 0 for e in r["weight_error"].values()), r
        assert r["tokens"] == data["steps"] * data["batch"]
    k3 = [r for r in data["results"] if r["spec"] == "kimi_k3.sched"]
    assert {r["spread"] for r in k3} >= {0, 4}         # a real checkpoint's spread, stated
    assert all(r["kl_mean"] > 0 for r in k3)


def test_a_spread_lowers_each_32_row_scale_by_up_to_that_many_octaves():
    hf = {"x.weight_packed": np.arange(8, dtype=np.uint8),
          "x.weight_scale": np.full((4, 64), 127, np.uint8)}
    out = format_quality.spread_scales(hf, 2, np.random.default_rng(0))
    assert out["x.weight_packed"] is hf["x.weight_packed"]
    drop = 127 - out["x.weight_scale"].astype(int)
    assert drop.min() == 0 and drop.max() == 2
    assert format_quality.spread_scales(hf, 0, np.random.default_rng(0)) == hf


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/format_quality.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})


def test_bad_arguments_are_usage_errors():
    r = _run("--spreads", "two", timeout=60)
    assert r.returncode == 2 and "integers, comma-separated" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.extended
def test_a_small_run_prints_its_rows():
    r = _run("--only", "qwen3_5_35b_a3b", "--steps", "2", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| `qwen3_5_35b_a3b.sched`")]
    assert len(rows) == 1 and "fp8 block 512 rounded" in rows[0]

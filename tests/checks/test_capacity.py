"""The VMEM capacity model pinned to what libtpu allocates (benchmarks/vmem_probe.py and
benchmarks/vmem_sweep.py measured these; the JSON data beside them is the evidence)."""
import json
from pathlib import Path

import pytest

from mkc import ir
from mkc.checks import capacity, vmem_budget
from mkc.compiler import check_spec
from mkc.trace import build_trace
from tests_support import SPEC

ROOT = Path(__file__).resolve().parents[2]
PROBES = ROOT / "benchmarks" / "data" / "vmem_probe.json"
SWEEP = ROOT / "benchmarks" / "data" / "vmem_sweep.json"


@pytest.mark.parametrize("rows, dtype, tile", [
    # bf16: a multiple of 16 rows takes (16, 128) tiles, 8 rows (8, 128), fewer a power of two
    # of at least 2 (two bf16 rows share a 32-bit sublane).
    (16, "bf16", 16), (32, "bf16", 16), (8, "bf16", 8), (24, "bf16", 8), (9, "bf16", 8),
    (1, "bf16", 2), (2, "bf16", 2), (3, "bf16", 4), (5, "bf16", 8),
    # 32-bit: (8, 128) tiles from 8 rows, else the next power of two, down to one row.
    (8, "f32", 8), (16, "f32", 8), (1, "f32", 1), (2, "f32", 2), (3, "f32", 4), (5, "f32", 8),
    (1, "int32", 1), (3, "int32", 4),
    # 8-bit: (32, 128) for a multiple of 32 rows, else 8, and at least 4 rows.
    (32, "u8", 32), (64, "int8", 32), (8, "u8", 8), (24, "int8", 8), (1, "u8", 4),
    (3, "int8", 4), (5, "u8", 8),
])
def test_tile_rows_by_dtype_and_height(rows, dtype, tile):
    assert ir.tile_rows(rows, dtype) == tile


def test_padded_bytes_of_the_kernels_batch_row_buffers():
    # the issue's false overflows: bf16 batch rows at B=8 take 8 rows, not 16
    assert ir.padded_bytes((2, 8, 8, 5120), "bf16") == 2 * 8 * 8 * 5120 * 2
    assert ir.padded_bytes((5, 8, 1024), "bf16") == 5 * 8 * 1024 * 2
    # ... at B=1 two rows, and f32 one row
    assert ir.padded_bytes((2, 8, 1, 5120), "bf16") == 2 * 8 * 2 * 5120 * 2
    assert ir.padded_bytes((27, 1, 1280), "f32") == 27 * 1280 * 4
    # ... at B=16 full (16, 128) bf16 tiles
    assert ir.padded_bytes((2, 8, 16, 5120), "bf16") == 2 * 8 * 16 * 5120 * 2
    # lanes pad to 128
    assert ir.padded_bytes((16, 130), "bf16") == 16 * 256 * 2
    assert ir.padded_bytes((16, 1), "f32") == 16 * 128 * 4
    # 1-D: 512-byte granules
    assert ir.padded_bytes((1500,), "f32") == 6144
    assert ir.padded_bytes((200,), "bf16") == 512


def test_scoped_buffers_and_windows_round_to_1kib():
    assert ir.padded_bytes((1, 128), "f32") == 512
    assert ir.padded_bytes((1, 128), "f32", scoped=True) == 1024
    # a 32-bit scoped buffer one lane-row wide is untiled: [2, 3, 128] takes 3 rows per plane
    assert ir.padded_bytes((2, 3, 128), "f32", scoped=True) == 3072
    assert ir.padded_bytes((2, 3, 128), "f32") == 4096
    assert ir.padded_bytes((2, 3, 128), "bf16", scoped=True) == 2048
    assert ir.window_bytes((27, 1, 1152), "f32") == 124928      # 27 * 1152 * 4 = 124416
    scoped = ir.Buffer("t", "kv", (1, 128), "bf16", scope=("gqa", 0, 0))
    assert scoped.vmem_bytes == 1024
    out = ir.Buffer("logits", "output", (27, 1, 1152), "f32")
    assert out.vmem_bytes == 124928


@pytest.mark.skipif(not PROBES.exists(), reason="no probe data")
def test_model_matches_every_probe_kernel():
    """Every probe kernel compiled by libtpu: the model's bytes are libtpu's, exactly."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vmem_probe import modelled
    data = json.loads(PROBES.read_text())
    checked = 0
    for r in data["results"]:
        if r["libtpu_bytes"] is None:
            continue
        assert modelled(r["case"]) == r["libtpu_bytes"], r["case"]["name"]
        checked += 1
    assert checked > 150


def test_usable_vmem_is_64_kib_under_the_chip(full):
    assert capacity.usable_vmem_bytes(full) == 67043328 == 64 * 2**20 - 64 * 2**10
    assert capacity.vmem_budget_bytes(full) == 67043328 - full.vmem_reserve


def test_compiler_scratch_grows_with_batch(full):
    b1 = capacity.compiler_overhead_bytes(full, 1)
    b8 = capacity.compiler_overhead_bytes(full, 8)
    b16 = capacity.compiler_overhead_bytes(full, 16)
    assert 0 < b1 < b8 < b16
    assert capacity.compiler_overhead_bytes(full, 32) > b16     # extrapolated, not flat


def test_budget_counts_inputs_outputs_and_compiler_scratch(full):
    peak, _, live = vmem_budget(full, build_trace(full), 8)
    names = {b.name for b in live}
    assert {"rope", "logits", "compiler_scratch"} <= names
    assert peak == sum(b.vmem_bytes for b in live)


@pytest.fixture(scope="module")
def full():
    return check_spec(SPEC).ir


def _sweep_variant(name):
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vmem_sweep import mkc_verdicts
    r = next(r for r in json.loads(SWEEP.read_text())["results"] if r["var"]["name"] == name)
    return mkc_verdicts(r["var"]), r["libtpu"]


@pytest.mark.skipif(not SWEEP.exists(), reason="no sweep data")
@pytest.mark.parametrize("name, fits", [
    ("qwen B16 ring 16", False),        # the issue's false fit: libtpu used 64.34 of 63.94 MiB
    ("qwen B16 ring 15", True),
    ("qwen B1 ring 24", True),          # the issue's false overflows
    ("qwen B8 ring 20", True),
    ("qwen B8 ring 21", False),
])
def test_the_issues_boundary_cases(name, fits):
    m, tpu = _sweep_variant(name)
    assert tpu["libtpu"] == ("fits" if fits else "out_of_vmem")
    assert m["fits"] is fits, (m["peak"], m["budget"])
    if fits:        # an upper bound within 128 KiB of what libtpu allocated
        assert 0 <= m["peak"] - tpu["used_bytes"] <= 128 << 10


@pytest.mark.slow
@pytest.mark.skipif(not SWEEP.exists(), reason="no sweep data")
def test_no_false_fit_in_the_sweep():
    """Every kernel libtpu rejected for VMEM in the sweep, mkc rejects too; and at the
    largest batch the verdicts agree at least 95 % of the time."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vmem_sweep import mkc_verdicts
    data = json.loads(SWEEP.read_text())
    largest = {}
    for r in data["results"]:
        largest[r["var"]["model"]] = max(largest.get(r["var"]["model"], 0), r["var"]["batch"])
    n = agree = 0
    for r in data["results"]:
        tpu = r["libtpu"]["libtpu"]
        if tpu not in ("fits", "out_of_vmem"):
            continue
        m = mkc_verdicts(r["var"])
        assert not (m["fits"] and tpu == "out_of_vmem"), r["var"]["name"]
        if r["var"]["batch"] == largest[r["var"]["model"]]:
            n += 1
            agree += m["fits"] == (tpu == "fits")
    assert n and agree / n >= 0.95


def test_a_limit_below_the_chips_vmem_is_named_and_raising_it_is_offered(tmp_path):
    """v6e has 128 MiB of VMEM a core: a spec capped at 40 MiB that needs 41.5 MiB at batch 8
    is told the limit is the cap and which limit fits, at the vmem line."""
    from mkc.diagnostics import MkcError
    text = (ROOT / "schedules" / "qwen3_8_27b_v6e.sched").read_text()
    spec = tmp_path / "capped.sched"
    spec.write_text(text.replace("vmem    limit 128 MiB reserve 6 MiB", "vmem    limit 40 MiB reserve 6 MiB"))
    with pytest.raises(MkcError) as e:
        check_spec(spec)
    d = next(d for d in e.value.diagnostics if d.code == "E-VMEM-CAPACITY")
    assert "the spec's limit 40.00 MiB minus reserve 6.00 MiB" in d.message
    assert d.hint.startswith("raise the limit: `vmem limit 48 MiB` fits") and d.span.line == 16

"""Compiled prices per op body (mkc.perf.op_measures): the key of an op is what sets its cycles
(ring depth and slot counts do not, rows and tiles do), the shipped op measures are a shipped
whole-kernel measure's op rows, a kernel is priced from its ops' measures with its statements
from a whole-kernel measure of the same spec, and a report priced by the count says so first.
One slow test compiles an op alone with libtpu."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mkc import compiler
from mkc.perf import bundles, op_measures
from mkc.perf.run import counted_warning, model, ops_counted, report, table

ROOT = Path(__file__).resolve().parents[2]
QWEN = ROOT / "schedules" / "qwen3_8_27b.sched"
MINI = "qwen3_8_mini"
RING = "ring weights: 19 slots of bf16 tiles up to 1024 x 768"


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """Empty op stores (shipped and the user's) and no op compiled alone."""
    monkeypatch.setattr(op_measures, "DATA", tmp_path / "shipped_ops")
    monkeypatch.setenv("MKC_OP_CACHE", str(tmp_path / "ops"))
    monkeypatch.setenv("MKC_OP_COMPILE", "0")
    return tmp_path


def _spec(text: str, model_name: str | None = None):
    path = Path("/dev/null/qwen.sched")
    from mkc.checks import run_checks
    from mkc.lang.parser import parse
    from mkc.resolve import resolve
    s = resolve(parse(text, str(path)), model_name)
    run_checks(s)
    return s


def _ring(text: str, slots: int, note: str = "") -> str:
    """The spec with `slots` ring slots, as many ahead (with `note`, a comment line above)."""
    ahead = "stream weights ahead 19 {"
    assert RING in text and ahead in text
    ring = RING.replace("19 slots", f"{slots} slots")
    return text.replace(RING, f"# {note}\n  {ring}" if note else ring).replace(
        ahead, ahead.replace("19", str(slots)))


def test_the_key_is_what_sets_cycles_ring_depth_no_rows_yes():
    """One more ring slot changes no op's key (a slot is an index, not work); another batch
    changes every op's; a spec name or a comment changes none."""
    text = QWEN.read_text()
    assert RING in text
    base = op_measures.op_bodies(_spec(text, MINI), 2)
    deeper = op_measures.op_bodies(_spec(_ring(text, 18), MINI), 2)
    wider = op_measures.op_bodies(_spec(text, MINI), 1)
    assert base and set(base) == set(deeper) == set(wider)
    assert all(base[k].key == deeper[k].key for k in base)
    assert all(base[k].key.digest != wider[k].key.digest for k in base)
    key = base["gqa", "o_proj"].key
    assert key.rows == 2 and key.chip == "tpu7x" and key.body.endswith("o_proj")
    assert "#" in key.shapes and key.id == op_measures.OpKey(**vars(key)).id


def test_a_ref_s_leading_dim_and_literals_are_masked_value_shapes_kept():
    text = ("a:i32[] = rem k 8:i32[]\n b:Ref<vmem>{bf16[8,1024,896]} c:f32[8,7168] "
            "d:Ref<semaphore_mem>{dma_sem[8]} e = scan[length=7] 2.5:f32[]")
    masked = op_measures._mask_numbers(text)
    assert "rem k #:i32[]" in masked and "bf16[#,1024,896]" in masked
    assert "f32[8,7168]" in masked and "dma_sem[#]" in masked and "length=7" in masked
    assert "#:f32[]" in masked


def test_shipped_op_measures_are_the_shipped_whole_kernel_rows(stores):
    """Deriving from the shipped whole-kernel measure of a spec gives its op rows under their
    keys; a measure of another module (its key stale) gives none."""
    s = compiler.check_spec(str(QWEN)).ir
    measure = bundles.cached(s, "decode", 1, places=(bundles.DATA,))
    assert measure is not None
    got = op_measures.derive(s, measure)
    ops = {r["key"]: r for r in measure["rows"] if r["group"] == "op"}
    assert got and len(got) == len({e["id"] for e in got}) <= len(ops)
    for e in got:
        k = e["key"]
        assert e["row"]["cycles"] == ops[f"{k['kind']}.{k['op']}"]["cycles"]
        assert e["origin"].startswith("derived: qwen3_8_27b decode kernel at 1 rows")
    assert op_measures.derive(s, measure | {"key": "0" * 20}) == []
    # and what is shipped is what deriving gives today
    shipped = op_measures.load("tpu7x", (op_measures.Path(op_measures.__file__).parent
                                         / "data" / "ops",))
    assert all(e["id"] in shipped for e in got)


def test_a_kernel_is_priced_from_its_op_measures_and_its_spec_s_statements(stores):
    """A neighbour of a shipped spec: the ring a slot shallower and a line added above its
    collectives. Every op is priced by the shipped spec's op measures (no compile), the
    collectives by the shipped whole-kernel measure with their spec lines moved; the step is
    within a percent of the whole-kernel price of the shipped spec."""
    s0 = compiler.check_spec(str(QWEN)).ir
    measure = bundles.cached(s0, "decode", 1, places=(bundles.DATA,))
    op_measures.save(op_measures.derive(s0, measure), "tpu7x")
    text = _ring(QWEN.read_text(), 18, "a slot fewer")
    s = _spec(text)
    m = op_measures.assemble(s, 1)
    o = m["op_level"]
    assert o["ops_derived"] >= len(o["origin"]) - 1 and not o["ops_compiled_alone"]
    assert "whole-kernel measure at 1" in o["statements_from"] and not o["collectives_counted"]
    ours = {r["spec_line"] for r in m["rows"] if r["group"] == "collective"}
    theirs = {r["spec_line"] for r in measure["rows"] if r["group"] == "collective"}
    assert ours == {line + 1 for line in theirs}
    assert "compiled per op" in op_measures.describe(m)
    whole = model(s0, 1).res.step_s
    per_op = model(s, 1).res.step_s
    assert abs(per_op / whole - 1) < 0.05


def test_another_model_under_the_spec_s_name_lends_it_no_statements(stores):
    """The shipped whole-kernel measures of qwen3_8_27b are of the full-size model: MINI under
    the same spec name takes none of their collectives' cycles."""
    s = _spec(QWEN.read_text(), MINI)
    assert bundles.cached(s, "decode", 1) is None
    m = op_measures.assemble(s, 1)
    assert m["op_level"]["statements_from"].startswith("counted")
    assert not op_measures._near(1000.0, 8000.0) and op_measures._near(2188.0, 2252.0)
    # its collectives are priced by their counted sums, and the report names each
    named = m["op_level"]["collectives_counted"]
    assert named and all("all-reduce" in c for c in named)
    assert set(named) <= set(ops_counted(m))


def test_a_counted_price_says_so_on_the_report_s_first_line(stores, monkeypatch):
    """Nothing measured and nothing compiling: counted, and the table opens with it; a price
    with some ops counted says which."""
    monkeypatch.setattr(bundles, "DATA", stores / "shipped")
    monkeypatch.setenv("MKC_BUNDLE_CACHE", str(stores / "bundles"))
    s = _spec(QWEN.read_text(), MINI)
    rep = report(model(s, 1))
    assert rep["priced_by"].startswith("counted:") and "MKC_OP_COMPILE=0" in rep["priced_by"]
    assert table(rep).splitlines()[0].startswith("COUNTED PRICE, not compiled")
    partly = {"priced_by": "compiled per op: ...", "ops_counted": {"gqa.o_proj": "x"}}
    assert counted_warning(partly).startswith("PARTLY COUNTED PRICE: 1 op(s) counted")
    collectives = {"priced_by": "compiled per op: ...", "ops_counted": {"gqa: all-reduce": "x"},
                   "collectives_counted": ["gqa: all-reduce"]}
    assert "1 collective(s) priced by their counted sums" in counted_warning(collectives)
    assert "op(s)" not in counted_warning(collectives)
    assert counted_warning({"priced_by": "compiled: ...", "ops_counted": {}}) is None


def test_the_store_keeps_one_entry_per_key_and_rereads_a_changed_file(stores):
    key = op_measures.OpKey("tpu7x", "1", "f", "gqa", "o_proj", 1, "f32[1,8]", "d")
    row = {"cycles": 10.0, "per_iteration": 0.0, "read_cycles": 0.0, "reads": 0, "bundles": 10.0}
    op_measures.save([op_measures.entry(key, row, "compiled alone")], "tpu7x")
    assert op_measures.load("tpu7x")[key.id]["row"]["cycles"] == 10.0
    time.sleep(0.01)
    op_measures.save([op_measures.entry(key, row | {"cycles": 12.0}, "compiled alone")], "tpu7x")
    got = op_measures.load("tpu7x")
    assert len(got) == 1 and got[key.id]["row"]["cycles"] == 12.0
    doc = json.loads((stores / "ops" / "tpu7x.json").read_text())
    assert doc["ops"][0]["key"]["op"] == "o_proj"


@pytest.mark.slow
def test_an_op_never_measured_is_compiled_alone_in_seconds(stores):
    """MINI's ops: none shipped; two compiled alone (one worker), kept, and found next time."""
    s = _spec(QWEN.read_text(), MINI)
    bodies = op_measures.op_bodies(s, 1)
    want = [("gqa", "o_proj"), ("gqa", "attn_residual")]
    t0 = time.perf_counter()
    entries, failed = op_measures.compile_ops(s, 1, None, bodies, want)
    assert time.perf_counter() - t0 < 30 and not failed
    rows = {e["key"]["op"]: e["row"] for e in entries}
    assert rows["o_proj"]["cycles"] > rows["attn_residual"]["cycles"] > 0   # a matmul's tiles
    m = op_measures.assemble(s, 1)
    assert {"gqa.o_proj", "gqa.attn_residual"} <= {
        k for k, v in m["op_level"]["origin"].items() if v == "compiled alone"}

"""`mkc perf --trace`: a valid trace-event file with the engine tracks, deterministic, whose
VMEM counter peaks at the checker's VMEM peak (Qwen MINI and K3, so pools and scoped buffers)."""
import json
import re

import pytest

from mkc.checks import vmem_budget
from mkc.cli import main
from mkc.compiler import check_spec
from mkc.perf.perfetto import VMEM_COUNTER, VMEM_TOTAL, trace_events
from mkc.perf.run import step_model
from tests_support import K3_SPEC, SPEC


def _threads(doc):
    return {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def _assert_well_formed(doc):
    events = doc["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X", "C"}
    names = _threads(doc)
    by_tid: dict[int, list] = {}
    for e in events:
        assert e["pid"] == 1
        if e["ph"] == "X":
            assert e["tid"] in names and e["dur"] >= 0 and e["ts"] >= 0 and e["name"]
            by_tid.setdefault(e["tid"], []).append(e)
    # Slices on one track follow each other (Perfetto nests slices of a thread; none overlap).
    for tid, xs in by_tid.items():
        xs.sort(key=lambda e: (e["ts"], e["dur"]))
        for a, b in zip(xs, xs[1:]):
            assert round(a["ts"] + a["dur"], 3) <= b["ts"], (names[tid], a, b)
    return names


@pytest.mark.parametrize("spec,model,batch,tokens", [(SPEC, "qwen3_8_mini", 8, 512),
                                                     (K3_SPEC, None, 1, 512)])
def test_trace_tracks_and_vmem_counter_peak_is_the_checkers(spec, model, batch, tokens):
    c = check_spec(spec, model)
    res = step_model(c.ir, batch, tokens)
    doc = json.loads(json.dumps(trace_events(c.ir, res, batch, tokens)))
    names = _assert_well_formed(doc)
    tracks = set(names.values())
    assert {"layers", "compute (ops)", "stalls (waits that blocked compute)",
            "collectives (ICI)"} <= tracks
    # a track per DMA queue (the engine round-robins: a queue per copy in flight) and class
    dma = {re.sub(r"^DMA queue \d+: ", "DMA queue: ", t) for t in tracks}
    assert {"DMA queue: ring", "DMA queue: kv"} <= dma
    if c.ir.pools:
        assert "DMA queue: pool staging.experts" in dma
    events = doc["traceEvents"]
    totals = [e["args"]["live"] for e in events if e["ph"] == "C" and e["name"] == VMEM_TOTAL]
    by_class = [e["args"] for e in events if e["ph"] == "C" and e["name"] == VMEM_COUNTER]
    assert [sum(r.values()) for r in by_class] == totals
    assert max(totals) == vmem_budget(c.ir, c.events, batch)[0]
    assert "ring" in by_class[0] and any(r.get("kv") for r in by_class)
    # Every DMA, stall and collective points at its spec line.
    spec_name = str(spec)
    for e in events:
        if e["ph"] == "X" and e["cat"] in ("dma", "stall", "collective"):
            if e["name"] != "head_norm":                 # a buffer mkc adds itself
                assert e["args"]["spec"].startswith(spec_name + ":"), e
    assert doc["otherData"]["modelled"].startswith("times are modelled")


def test_cli_trace_is_deterministic(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--batch", "1",
                     "--context", "256", "--trace", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert a.read_bytes() == b.read_bytes()
    doc = json.loads(a.read_text())
    assert doc["otherData"]["batch"] == 1 and doc["otherData"]["tokens_in_cache"] == 256
    _assert_well_formed(doc)


def test_several_dma_queues_get_a_track_each_whose_slices_never_overlap():
    """Copies on different queues overlap in time (they share the bandwidth); within a queue
    they follow each other, so each (queue, class) is a track of its own. K3 at batch 1 is an
    expectation over routing: the trace draws its nearer whole expert count."""
    from mkc.perf import constants
    c = check_spec(K3_SPEC)
    rates = constants.rates("tpu7x").replace(dma_queues=2)
    res = step_model(c.ir, 1, 512, rates)
    assert res.parts and res.concrete() is not res
    doc = json.loads(json.dumps(trace_events(c.ir, res, 1, 512)))
    names = _assert_well_formed(doc)                 # no overlap within a track
    tracks = set(names.values())
    assert {"DMA queue 0: ring", "DMA queue 1: ring"} <= tracks
    dma = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "dma"]
    assert {e["args"]["queue"] for e in dma} == {0, 1}
    other = doc["otherData"]
    assert other["routed_experts_per_layer"] == round(res.experts)
    assert other["expected_step_us"] == pytest.approx(res.step_s * 1e6, abs=1e-3)
    assert other["step_us"] == pytest.approx(res.concrete().step_s * 1e6, abs=1e-3)

"""The model's trace is the checked trace: same builder, same program order, plus op and
collective events; op facts reach the IR from the graph."""
import dataclasses

from mkc.compiler import check_spec
from mkc.perf.run import perf_trace
from mkc.steps.collectives import OverlapAdvance, OverlapFinish, OverlapStart
from mkc.trace import (Collective, CopyStart, EpilogueBegin, LayerBegin, OpBegin, Read, TraceOptions,
                       build_trace)
from tests_support import K3_SPEC, SPEC, k3_format_text

NEW = (OpBegin, Collective, LayerBegin, EpilogueBegin)


def _key(e):
    """The event apart from its place in the trace, and a read's bytes (the model's only)."""
    return dataclasses.replace(e, seq=0, **({"nbytes": 0} if isinstance(e, Read) else {}))


def test_default_options_give_the_checked_trace():
    c = check_spec(SPEC, "qwen3_8_mini")
    assert build_trace(c.ir, TraceOptions()) == c.events


def test_compute_events_only_add_to_the_checked_trace():
    for spec, model in ((SPEC, "qwen3_8_mini"), (K3_SPEC, None)):
        c = check_spec(spec, model)
        full = build_trace(c.ir, TraceOptions(compute=True))
        assert [_key(e) for e in full if not isinstance(e, NEW)] == [_key(e) for e in c.events]
        ops = [e for e in full if isinstance(e, OpBegin)]
        n_ops = sum(len(c.ir.kinds[k].ops) for k in c.ir.layer_kinds) + 3   # embed, norm, head
        assert len(ops) == n_ops
        # a collective run at once is one event; an overlapped one begins with its start
        colls = [e for e in full if isinstance(e, Collective)
                 and not isinstance(e.tag, (OverlapAdvance, OverlapFinish))]
        per_layer = sum(len(c.ir.kinds[k].allreduces) + len(c.ir.kinds[k].allgathers)
                        + len(c.ir.kinds[k].exchanges) for k in c.ir.layer_kinds)
        assert len(colls) == per_layer + 1                                     # + embedding
        finishes = [e for e in full if isinstance(e, Collective) and isinstance(e.tag, OverlapFinish)]
        assert len(finishes) == sum(isinstance(e.tag, OverlapStart) for e in colls)
        # every weight read carries its bytes
        assert all(e.nbytes > 0 for e in full if isinstance(e, Read) and e.buffer == c.ir.stream.ring)


def test_model_trace_is_sized_at_the_batch_with_the_whole_kv_stream():
    c = check_spec(SPEC, "qwen3_8_mini")
    kv = next(k.kv for k in c.ir.kinds.values() if k.kv)
    b1, b8 = perf_trace(c.ir, 1, 1024), perf_trace(c.ir, 8, 1024)
    kv_bufs = {b.name for b in c.ir.buffers if b.cls == "kv" and b.scope}
    kv_starts = [e for e in b8 if isinstance(e, CopyStart) and e.buffer in kv_bufs]
    layers = sum(1 for k in c.ir.layer_kinds if c.ir.kinds[k].kv)
    assert len(kv_starts) == layers * len(kv_bufs) * (1024 // kv.tokens)
    state1 = sum(e.nbytes for e in b1 if isinstance(e, CopyStart) and e.hbm)
    state8 = sum(e.nbytes for e in b8 if isinstance(e, CopyStart) and e.hbm)
    assert state8 == 8 * state1


def test_matrix_facts_say_how_stored_bytes_count_as_values(tmp_path):
    mx = check_spec(K3_SPEC).ir                                        # the checkpoint's MXFP4
    ir = {}
    for fmt in ("fp4 block", "fp8 block"):                             # format expert.* FMT N
        spec = tmp_path / fmt.replace(" ", "_") / "kimi_k3.sched"
        spec.parent.mkdir()
        spec.write_text(k3_format_text(fmt))
        ir[fmt] = check_spec(spec).ir
    fp4, fp8 = ir["fp4 block"], ir["fp8 block"]
    assert fp8.matrix_facts["moe.expert.gate_up_codes"].values_per_byte == 1.0
    assert fp4.matrix_facts["moe.expert.gate_up_codes"].values_per_byte == 2.0   # two codes a byte
    assert mx.matrix_facts["moe.expert.gate_up_codes"].values_per_byte == 2.0
    for s in (fp8, fp4, mx):
        assert s.matrix_facts["moe.expert.gate_up_scales"].values_per_byte == 0   # not multiplied

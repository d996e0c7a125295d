"""The bundle report: libtpu's final LLO read (mkc.perf.llo) and charged per op
(mkc.perf.bundles). The parsing and charging are checked on LLO text written here; one slow
test compiles a shipped kernel with libtpu and checks the report against the schedule."""
# ruff: noqa: E501  (LLO text is quoted as libtpu prints it, lines and all)
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mkc import compiler
from mkc.perf import bundles, llo

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "generated" / "qwen3_8_27b.py"

# A kernel of three bundles before a loop of two bundles that runs 30 times, then an empty
# bundle (a delay, printed without its nesting) and one more: the shape libtpu prints.
LLO_TEXT = '''= control target key start
LB: loop body
= control target key end

     0   :  { %v1_v0 = vld [vmem:[#allocation1] sm:$0xff] /* loc("m.py":10:4 to :9) */  ;;  %s2_s1 = smov 0 }
   0x1   :  { %v3_v1 = vexp2.f32 %v1_v0 /* loc("m.py":10:4 to :9) */ }
   0x2   :  { %v4_v2 = vpop.eup %3 }
   0x3 LB: > { %5 = vmatpush1.bf16.msra.mxu0 %v4_v2 /* loc("m.py":11:4 to :9) */  ;;  %s6_s2 = sadd.s32 1, %s2_s1  ;;  %s2_s1 = sphi %s0, %s6_s2 }
   0x4   : > { %p7_p0 = scmp.ge.s32.totalorder %s6_s2, 30  ;;  %v8_v3 = vrot.lane.b32.xlu0 %v4_v2, %s6_s2 /* loc("m.py":11:4 to :9) */ }
   0x5   :  {}
   0x6   :  { %9 = vst [vmem:[#allocation2] sm:$0xff] /*vst_source=*/%v8_v3 /* loc("m.py":10:4 to :9) */ }
'''


def test_llo_bundles_loops_and_slots_are_read():
    b = llo.parse(LLO_TEXT, "m.py")
    assert [x.address for x in b] == [0, 1, 2, 3, 4, 5, 6]
    assert [x.depth for x in b] == [0, 0, 0, 1, 1, 1, 0]        # the delay keeps its depth
    assert [i.slot for i in b[3].instructions] == [llo.MXU, llo.SCALAR, None]
    assert [i.slot for i in b[1].instructions + b[2].instructions] == [llo.EUP, llo.EUP]
    assert b[4].instructions[1].slot == llo.XLU and b[6].instructions[0].slot == llo.VSTORE
    assert b[0].instructions[0].lines == (10,) and b[0].instructions[1].lines == ()
    (loop,) = llo.loops(b)
    assert (loop.first, loop.last, loop.depth, loop.trips) == (3, 5, 1, 30)
    assert llo.slot_capacity(b)[llo.VLOAD] == 1


def test_a_loop_without_a_constant_bound_has_run_time_trips():
    text = LLO_TEXT.replace("%s6_s2, 30", "%s6_s2, %s9_s3")
    assert llo.loops(llo.parse(text, "m.py"))[0].trips is None


def test_a_run_time_loop_around_a_counted_one_keeps_its_run_time_trips():
    # the KV-tile loop of an attention (bound in a register) around a loop of 2 (a tile's
    # halves): the inner loop's exit test is not the outer one's
    text = """
   0x0 LB: > { %s2_s1 = sphi %s0, %s6_s2 ;; %v1_v0 = vld [vmem:[#allocation1] sm:$0xff] }
   0x1 LB: >> { %s12_s4 = sphi %s0, %s16_s5 ;; %16 = vmatpush1.bf16.msra.mxu0 %v1_v0 }
   0x2   : >> { %s16_s5 = sadd.s32 1, %s12_s4 }
   0x3   : >> { %p17_p1 = scmp.ge.s32.totalorder %s16_s5, 2 }
   0x4   : > { %s6_s2 = sadd.s32 1, %s2_s1 }
   0x5   : > { %p7_p0 = scmp.ge.s32.totalorder %s6_s2, %s9_s3 }
   0x6   :  { %s8_s6 = smov 0 }
"""
    outer, inner = llo.loops(llo.parse(text, "m.py"))
    assert (outer.first, outer.last, outer.trips) == (0, 5, None)
    assert (inner.first, inner.last, inner.trips) == (1, 3, 2)


def test_bundles_are_charged_by_location_and_program_order():
    labels = {10: bundles.Label("op", "tail", "first"), 11: bundles.Label("op", "tail", "second")}
    rows = {r.key: r for r in bundles.rows(llo.parse(LLO_TEXT, "m.py"), labels, layers=4)}
    first, second = rows["tail.first"], rows["tail.second"]
    # the loop's unlocated scalar work follows its located push; the store after the loop is
    # located back at line 10, which program order does not allow: it stays with `second`
    assert first.bundles == 3 and second.bundles == 4
    assert first.cycles == 3 and second.cycles == 1 + 30 * 3
    assert second.slots[llo.MXU] == 30 and second.slots[llo.VSTORE] == 1
    assert sum(r.bundles for r in rows.values()) == 7


def test_lines_of_a_generated_module_name_what_they_run():
    source = GENERATED.read_text()
    labels = bundles.line_labels(source)
    lines = source.splitlines()
    at = {text.strip(): n + 1 for n, text in enumerate(lines)}
    assert labels[at["proj = lower.in_proj(c, h)"]].key == "gdn.in_proj"
    assert labels[at["core = lower.attention(c, q)"]].key == "gqa.attention"
    reduce = next(n + 1 for n, t in enumerate(lines) if "k.allreduce(attn_out, GDN_OUT" in t)
    assert labels[reduce].key == "gdn: all-reduce (spec line 46)"
    lm_head = next(n + 1 for n, t in enumerate(lines) if "ring.matmul(RING, k.ring_refs, h" in t)
    assert labels[lm_head].key == "tail.lm_head"
    enter = next(n + 1 for n, t in enumerate(lines) if "collectives.enter(" in t)
    assert labels[enter].key == "entry barrier"


def test_a_stale_or_foreign_cache_entry_is_not_used(tmp_path, monkeypatch):
    s = compiler.check_spec(str(ROOT / "schedules" / "qwen3_8_27b.sched")).ir
    monkeypatch.setattr(bundles, "DATA", tmp_path / "shipped")
    monkeypatch.setenv("MKC_BUNDLE_CACHE", str(tmp_path / "cache"))
    entry = {"schema": bundles.SCHEMA, "key": "0" * 20, "spec": s.name, "kernel": "decode",
             "batch": 1, "rows": []}
    bundles.save(entry)
    assert bundles.cached(s, "decode", 1) is None
    with pytest.raises(bundles.BundleError, match="no bundles measured"):
        bundles.bundle_report(s, "decode", 1, compile_missing=False)
    path = tmp_path / "cache" / f"{s.name}.json"
    path.write_text("{not json")
    assert bundles.cached(s, "decode", 1) is None


def test_a_lowering_function_rewritten_to_emit_the_same_kernel_keeps_its_measure(monkeypatch):
    """The key is what libtpu compiles, not mkc's code: a body moved behind another function
    (as a shared layer library does), or a comment added to the module, keeps the shipped
    measure; one more operation loses it."""
    from mkc.families.qwen3_5 import lowering
    from mkc.perf import work
    s = compiler.check_spec(str(ROOT / "schedules" / "qwen3_8_27b.sched")).ir
    original = lowering.BODIES["gdn", "gated_norm"]
    work.clear_cache()
    monkeypatch.setitem(lowering.BODIES, ("gdn", "gated_norm"), lambda c, *args: original(c, *args))
    assert bundles.cached(s, "decode", 1, places=(bundles.DATA,)) is not None
    from mkc.codegen.emit import render
    source = render(s, "")
    commented = source.replace("\ndef _kernel(", "\n# a comment\ndef _kernel(", 1)
    assert commented != source and bundles.cached(s, "decode", 1, commented, (bundles.DATA,))
    monkeypatch.setitem(lowering.BODIES, ("gdn", "gated_norm"), lambda c, *args: original(c, *args) * 1.01)
    work.clear_cache()
    assert bundles.cached(s, "decode", 1, places=(bundles.DATA,)) is None
    monkeypatch.undo()
    work.clear_cache()


@pytest.mark.slow
def test_the_compiled_kernel_is_reported_per_op_and_grows_with_an_op_s_work():
    """Qwen 3.8 27B's decode kernel at batch 1 compiled by libtpu: every op of both layer
    kinds has a row, the streamed matmuls' tile loops run as many trips as the schedule has
    tiles, the bundles add up, and work added at one op's call shows in that row alone."""
    from mkc.codegen.emit import render
    s = compiler.check_spec(str(ROOT / "schedules" / "qwen3_8_27b.sched")).ir
    source = render(s, "")
    entry = bundles.measure(s, "decode", 1, source=source)
    rows = {r["key"]: r for r in entry["rows"]}
    for kind, ops in (("gdn", ("in_proj", "delta_rule", "out_proj", "gate_up", "down")),
                      ("gqa", ("qkv_gate", "attention", "o_proj", "gate_up", "down"))):
        for op in ops:
            assert f"{kind}.{op}" in rows, sorted(rows)
    for key, matrix in (("gdn.in_proj", "GDN_IN_PROJ"), ("gdn.gate_up", "GDN_GATE_UP"),
                        ("gqa.down", "GQA_DOWN"), ("tail.lm_head", "TAIL_LM_HEAD")):
        hot = rows[key]["hottest"]
        assert hot["trips"] == _tiles(source, matrix), (key, hot)
    assert sum(r["bundles"] for r in entry["rows"]) == pytest.approx(entry["bundles"], abs=0.5)
    assert rows["gqa.attention"]["per_iteration"] > 0          # its KV-tile loop
    json.dumps(entry)

    heavier = source.replace("    h = lower.post_norm(c)\n    act = lower.gate_up(c, h)",
                             "    h = lower.post_norm(c); h = jnp.tanh(jnp.tanh(jnp.tanh(h)))\n"
                             "    act = lower.gate_up(c, h)", 1)
    assert heavier != source
    heavier_entry = bundles.measure(s, "decode", 1, source=heavier)
    grown = {r["key"]: r for r in heavier_entry["rows"]}
    assert grown["gdn.post_norm"]["slots"].get(llo.EUP, 0) >= \
        rows["gdn.post_norm"]["slots"].get(llo.EUP, 0) + 3 * 5    # 3 tanh of 5 dense registers
    assert grown["gdn.post_norm"]["cycles"] > rows["gdn.post_norm"]["cycles"] + 20
    assert grown["gqa.post_norm"]["cycles"] == pytest.approx(rows["gqa.post_norm"]["cycles"], rel=0.2)
    # and the compiled price of the step grows by about those cycles, 48 gdn layers of them
    from mkc.perf import constants
    from mkc.perf.run import step_model
    rates = constants.rates(s.chip)
    before, after = (step_model(s, 1, s.context, keep_timeline=False, compiled=e).op_costs
                     for e in (entry, heavier_entry))
    added = 48 * (grown["gdn.post_norm"]["cycles"] - rows["gdn.post_norm"]["cycles"])
    assert after["gdn", "post_norm"].seconds - before["gdn", "post_norm"].seconds == \
        pytest.approx(added * rates.cycle_s, rel=1e-6)


def _tiles(source: str, matrix: str) -> int:
    import re
    m = re.search(matrix + r" = StreamedMatrix\(.*?row_tiles=(\d+), col_tiles=(\d+)", source, re.S)
    return int(m.group(1)) * int(m.group(2))


@pytest.mark.slow
@pytest.mark.parametrize("spec", sorted(p.stem for p in (ROOT / "schedules").glob("*.sched")))
def test_every_shipped_spec_has_its_compiled_measures_and_prices_each_op_from_them(spec):
    """The shipped measures (benchmarks/bundles.py) are those of today's modules and libtpu:
    `mkc perf --bundles` and `--compiled` need no compile on a shipped spec, every op of the
    step has a compiled row, is merged into its neighbours' (libtpu's code for it is in theirs)
    or says why it was counted, and nearly all have rows."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bundles as shipped
    from mkc.perf.run import run
    s = compiler.check_spec(str(ROOT / "schedules" / f"{spec}.sched")).ir
    for kernel, batch in shipped.kernels(s):
        entry = bundles.cached(s, kernel, batch, places=(bundles.DATA,))
        assert entry is not None, (f"{spec}: the shipped {kernel} measure at {batch} is stale: "
                                   f".venv/bin/python benchmarks/bundles.py --only {spec}")
        assert bundles.text(entry).startswith(f"{s.name}: {kernel} kernel")
    if spec not in ("qwen3_8_27b", "gpt_oss_20b", "qwen3_5_35b_a3b"):
        return                        # the step priced on one spec of each small family
    rep = run(s, s.batch_max, compiled=True)
    sources = [e["source"] for e in rep["op_costs"]]
    assert all(src.startswith(("compiled: row", "compiled: merged by libtpu into its neighbours",
                               "counted: the compiled kernel has no row")) for src in sources)
    assert sum(src.startswith("compiled: row") for src in sources) >= 0.9 * len(sources), sources


# A layer loop of 4 trips over two kinds' branches, each after an instruction of the dispatch
# (line 9): kind a's (its mix, line 20, and proj, line 21), then kind b's: its own attn (line
# 30), then code libtpu merged with a's proj (it keeps line 21), then an unlocated bundle.
BRANCHES_LLO = '''
     0   :  { %s0_s0 = smov 0 /* loc("m.py":5:4 to :9) */ }
   0x1 LB: > { %s2_s1 = sphi %s0_s0, %s6_s2  ;;  %s3_s3 = sadd.s32 0, %s2_s1 /* loc("m.py":9:4 to :9) */ }
   0x2   : > { %v1_v0 = vld [vmem:[#allocation1] sm:$0xff] /* loc("m.py":20:4 to :9) */ }
   0x3   : > { %v2_v1 = vadd.f32 %v1_v0, %v1_v0 /* loc("m.py":21:4 to :9) */ }
   0x4   : > { %s4_s4 = sadd.s32 1, %s3_s3 /* loc("m.py":9:4 to :9) */ }
   0x5   : > { %v3_v2 = vld [vmem:[#allocation1] sm:$0xff] /* loc("m.py":30:4 to :9) */ }
   0x6   : > { %v4_v3 = vmul.f32 %v3_v2, %v3_v2 /* loc("m.py":21:4 to :9) */ }
   0x7   : > { %v5_v4 = vmul.f32 %v4_v3, %v4_v3 /* loc("m.py":21:4 to :9) */ }
   0x8   : > { %v6_v5 = vadd.f32 %v5_v4, %v4_v3  ;;  %s6_s2 = sadd.s32 1, %s2_s1 }
   0x9   : > { %p7_p0 = scmp.ge.s32.totalorder %s6_s2, 4 }
   0xa   :  { %9 = vst [vmem:[#allocation2] sm:$0xff] /*vst_source=*/%v6_v5 /* loc("m.py":5:4 to :9) */ }
'''


def test_a_branch_merged_with_an_earlier_kind_s_code_is_charged_to_its_own_kind():
    """Without the dispatch's split, the two merged instructions after b's one own location
    outvote it and b's branch is charged to a; with it, b's branch is b's."""
    labels = {5: bundles.Label("kernel", "", "other"),
              9: bundles.Label("kernel", "", "layer loop"),
              20: bundles.Label("op", "a", "mix"), 21: bundles.Label("op", "a", "proj"),
              30: bundles.Label("op", "b", "attn")}
    parsed = llo.parse(BRANCHES_LLO, "m.py")
    rows = {r.key: r for r in bundles.rows(parsed, labels, layers=4, kinds={"a": 0, "b": 1})}
    # each branch from its dispatch instruction on: b's 0x4-0x9, a's 0x1-0x3
    assert rows["b.attn"].cycles == 6
    assert rows["a.mix"].cycles == 2 and rows["a.proj"].cycles == 1
    assert sum(r.bundles for r in rows.values()) == len(parsed)
    # One dispatch instruction only: the body cannot be split, so it is charged as before,
    # by the longest run in kind order, and b's branch goes to a.
    one_mark = BRANCHES_LLO.replace('%s4_s4 = sadd.s32 1, %s3_s3 /* loc("m.py":9:4 to :9) */',
                                    '%s4_s4 = sadd.s32 1, %s3_s3')
    unsplit = {r.key for r in bundles.rows(llo.parse(one_mark, "m.py"), labels, layers=4,
                                           kinds={"a": 0, "b": 1})}
    assert "b.attn" not in unsplit
    # A third merged instruction leaves a with fewer of its own lines in its branch than in
    # b's: that split is not the dispatch's (GPT-OSS's gqa and moe lie between two of its
    # instructions), so it is not used either.
    third = BRANCHES_LLO.replace("%v6_v5 = vadd.f32 %v5_v4, %v4_v3  ;;",
                                 '%v6_v5 = vadd.f32 %v5_v4, %v4_v3 /* loc("m.py":21:4 to :9) */  ;;')
    assert "b.attn" not in {r.key for r in bundles.rows(llo.parse(third, "m.py"), labels, layers=4,
                                                        kinds={"a": 0, "b": 1})}

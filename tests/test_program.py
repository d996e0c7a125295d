"""Scoped ranges: every layout resolve accepts lowers to properly nested `pl.run_scoped` blocks,
and the shapes that once generated broken code (nested, abutting) run in interpret mode."""
import ast as pyast
import itertools

import pytest

from mkc import compiler, ir
from mkc.diagnostics import MkcError
from mkc.program import layer_program
from tests_support import ROOT, SPEC, run_example

GDN_STATE = """    scoped conv_buf from start to out_proj
    load  state.conv -> conv_buf, state.recurrent -> rec_buf at start; wait before conv
    store conv_buf -> state.conv after conv; wait after out_proj
    store rec_buf -> state.recurrent after delta_rule; wait before next gdn
"""
GDN_OPS = ["input_norm", "in_proj", "conv", "delta_rule", "gated_norm", "out_proj",
           "attn_residual", "post_norm", "gate_up", "down", "mlp_residual"]

# The recurrent state scoped inside the conv state's scope's layer...
NESTED = """    scoped conv_buf from start to delta_rule
    scoped rec_buf from start to gated_norm
    load  state.conv -> conv_buf, state.recurrent -> rec_buf at start; wait before conv
    store conv_buf -> state.conv after conv; wait after delta_rule
    store rec_buf -> state.recurrent after delta_rule; wait after gated_norm
"""
# ...and one scope ending right where the next begins (the close and the open share a point).
ABUTTING = """    scoped conv_buf from start to conv
    scoped rec_buf from delta_rule to gated_norm
    load  state.conv -> conv_buf at start; wait before conv
    store conv_buf -> state.conv after conv; wait after conv
    load  state.recurrent -> rec_buf before delta_rule; wait before delta_rule
    store rec_buf -> state.recurrent after delta_rule; wait after gated_norm
"""


def _variant(tmp_path, gdn: str):
    text = SPEC.read_text()
    assert GDN_STATE in text
    spec = tmp_path / "variant.sched"
    spec.write_text(text.replace(GDN_STATE, gdn))
    return spec


def _assert_nested(steps) -> None:
    stack = []
    for st in steps:
        if st.kind == "scope_open":
            stack.append(st.scope)
        elif st.kind == "scope_close":
            assert stack and stack.pop() == st.scope, steps
    assert not stack


def test_every_accepted_pair_of_scopes_nests_and_generates_valid_python(tmp_path):
    """All placements of two scopes over the gdn ops (both stores waited inside the layer, the
    loads at the scope starts): each is rejected with a diagnostic or lowers to nested blocks."""
    accepted = 0
    points = range(len(GDN_OPS))
    for a0, a1, b0, b1 in itertools.product(points, repeat=4):
        if a1 < a0 or b1 < b0 or (a0, a1) > (b0, b1) or a1 > 4 or b0 < 3:
            continue         # conv_buf must cover conv and rec_buf delta_rule..gated_norm
        gdn = (f"    scoped conv_buf from {GDN_OPS[a0]} to {GDN_OPS[a1]}\n"
               f"    scoped rec_buf from {GDN_OPS[b0]} to {GDN_OPS[b1]}\n"
               f"    load  state.conv -> conv_buf before {GDN_OPS[a0]}; wait before conv\n"
               f"    store conv_buf -> state.conv after conv; wait after {GDN_OPS[a1]}\n"
               f"    load  state.recurrent -> rec_buf before {GDN_OPS[b0]}; wait before delta_rule\n"
               f"    store rec_buf -> state.recurrent after delta_rule; wait after {GDN_OPS[b1]}\n")
        try:
            c = compiler.compile_spec(_variant(tmp_path, gdn), "qwen3_8_mini")
        except MkcError:
            continue
        accepted += 1
        _assert_nested(layer_program(c.ir, "gdn"))
        tree = pyast.parse(c.module_source)
        defined = {n.name for n in pyast.walk(tree) if isinstance(n, pyast.FunctionDef)}
        called = {n.func.id for n in pyast.walk(tree)
                  if isinstance(n, pyast.Call) and isinstance(n.func, pyast.Name)}
        assert {f for f in called if f.startswith("_scope_")} <= defined
    assert accepted >= 5, accepted


@pytest.mark.slow
@pytest.mark.parametrize("gdn", [NESTED, pytest.param(ABUTTING, marks=pytest.mark.extended)],
                         ids=["nested", "abutting"])
def test_scope_shapes_run_in_interpret_mode(tmp_path, gdn):
    summary = run_example("examples/run_mini.py", "--spec", str(_variant(tmp_path, gdn)),
                          "--steps", "1", "--batch", "2", "--mode", "on_wait", timeout=1200)
    for s in summary["steps"]:
        assert s["next_token"] == s["ref_next_token"], s
        assert s["logits_max_abs_err"] < 0.03 * s["logits_max_abs"], s


def test_a_prefetch_after_an_op_starts_before_its_collectives():
    """K3's `prefetch next staging.attention after routed_experts`: the experts' view closes
    and the next layer's attention starts copying as soon as the experts' compute ends, so
    HBM streams under the experts' all-reduce instead of idling."""
    from mkc.steps import AllReduce, Prefetch, ViewClose
    from tests_support import K3_SPEC

    steps = layer_program(compiler.check_spec(K3_SPEC).ir, "moe")
    order = [type(st).__name__ + ("" if isinstance(st, Prefetch) else f" {getattr(st, 'op', '')}")
             for st in steps if isinstance(st, (AllReduce, Prefetch, ViewClose))]
    assert order[-3:] == ["ViewClose ", "Prefetch", "AllReduce routed_experts"]


def test_copies_at_a_point_start_before_an_overlapped_collective_lands_there():
    """Muse Spark's `allgather latent_down over tp overlap` runs under the router and routing,
    and lands before latent_norm, where `fetch experts ... after route` starts the expert
    copies: they start first, so HBM does not wait on the gather's last stage."""
    from mkc.steps import Fetch, Op, OverlapFinish, OverlapStart

    steps = layer_program(compiler.check_spec(ROOT / "schedules" / "muse_spark.sched").ir, "moe")
    order = [f"{type(st).__name__} {getattr(st, 'op', '')}".strip() for st in steps
             if isinstance(st, (Fetch, Op, OverlapFinish, OverlapStart))]
    start = order.index("OverlapStart")
    assert order[start - 1:] == ["Op latent_down", "OverlapStart", "Op router", "Op route", "Fetch",
                                 "OverlapFinish", "Op latent_norm", "Op routed_experts",
                                 "Op expert_norm", "Op latent_up", "Op mlp_residual"], order


def _ring_starts(s, batch: int) -> list:
    """The ring's copy starts in the trace of a step of `batch` rows: every tile of the step
    once, in stream order."""
    from mkc.trace import CopyStart, TraceOptions, build_trace
    events = build_trace(s, TraceOptions(batch=batch, whole_runs=True))
    ring = [e for e in events if isinstance(e, CopyStart) and e.buffer == s.stream.ring]
    assert [e.tag.index for e in ring] == list(range(s.stream.total_tiles))
    return ring


def test_held_back_refills_start_after_their_op():
    """Muse Spark's `refill weights after routed_experts`: the ring refills its MoE layers'
    latent_down tiles free start with the next layer's o_proj prefetch, before the experts'
    all-reduce, in every kernel. Every tile of the step is started once, in stream order."""
    from mkc.steps import AllReduce, Prefetch, Refill
    s = compiler.check_spec(ROOT / "schedules" / "muse_spark.sched").ir
    steps = layer_program(s, "moe")
    order = [type(st).__name__ for st in steps if isinstance(st, (AllReduce, Prefetch, Refill))]
    assert order == ["Prefetch", "Refill", "AllReduce"], order
    held = s.kinds["moe"].refill
    assert (held.after_op, held.from_rows, held.to_rows) == ("routed_experts", 1, 0)
    assert held.tiles == next(f.tiles for f in s.stream.families["moe"] if f.name == "latent_down")
    first = s.stream.layer_tile_offset[3]           # the second model layer's MoE (kind moe)
    assert s.layer_kinds[3] == "moe"
    for batch in (1, 8):
        ring = _ring_starts(s, batch)
        refills = [e for e in ring if first + s.stream.ahead <= e.tag.index
                   < first + s.stream.ahead + held.tiles]
        assert len(refills) == held.tiles
        assert all(e.where.endswith("moe before expert_norm") for e in refills), \
            [e.where for e in refills]


def test_refills_for_the_op_s_own_tiles_start_as_read_the_rest_after_it():
    """Muse Spark's `refill weights after qkv_gate from 2 rows` on its attention layers: qkv_gate
    reads 12 tiles through a ring 8 ahead, so its first 4 tiles' refills are its own last 4 and
    start as each is read; the refills its last 8 free (the MoE's tiles) start after qkv_gate,
    in kernels of 2 rows or more. Every tile of the step is started once, in stream order."""
    s = compiler.check_spec(ROOT / "schedules" / "muse_spark.sched").ir
    ahead = s.stream.ahead
    for kname in ("swa", "full"):
        held = s.kinds[kname].refill
        assert (held.after_op, held.tiles, held.from_rows) == ("qkv_gate", 12, 2)
        assert list(ir.held_refills(held.tiles, ahead)) == list(range(12 - ahead, 12))
    layer = s.layer_kinds.index("swa", 4)
    first = s.stream.layer_tile_offset[layer]
    after = s.kinds["swa"].ops[s.kinds["swa"].ops.index("qkv_gate") + 1]
    for batch in (1, 2):
        ring = _ring_starts(s, batch)
        where = {e.tag.index - first - ahead: e.where.split(" swa ")[-1] for e in ring
                 if first + ahead <= e.tag.index < first + ahead + 12}
        own = 12 - ahead
        assert all(where[k] == "qkv_gate" for k in range(own)), where
        later = "qkv_gate" if batch == 1 else f"before {after}"
        assert all(where[k] == later for k in range(own, 12)), where


def test_kv_tiles_at_layer_start_are_copied_from_point_zero_and_waited_by_the_row_write():
    """Muse Spark's `kv tiles ... at layer start`: the tile buffers are scoped from the layer's
    start to attention, the first `ahead` tiles' copies start there, kv_write waits them (and
    writes its rows into them) and attention waits only the later tiles, each started as a
    tile `ahead` before it is read."""
    from mkc.steps import KvStart, Op, ScopeClose, ScopeOpen
    from mkc.trace import Alloc, CopyStart, CopyWait, Free, Read, TraceOptions, Write, build_trace

    s = compiler.check_spec(ROOT / "schedules" / "muse_spark.sched").ir
    kv = s.kinds["swa"].kv
    assert kv.at_start and kv.writer == "kv_write" and kv.op == "attention"
    steps = layer_program(s, "swa")
    marks = [f"{type(st).__name__} {getattr(st, 'op', '')}".strip() for st in steps
             if isinstance(st, (KvStart, Op, ScopeClose, ScopeOpen))]
    assert marks[:2] == ["ScopeOpen", "KvStart"], marks
    assert marks[marks.index("Op attention") + 1] == "ScopeClose", marks
    opened = next(st for st in steps if isinstance(st, ScopeOpen))
    assert {b.name for b in opened.buffers} == set(kv.tile_buffers)
    # a tile holds each sequence's tokens: a verify kernel's 8 rows are one sequence
    from mkc.codegen.layers import layer_source
    assert f"pltpu.VMEM(({kv.slots}, c.S, {kv.tokens}, " in layer_source(s, "swa")

    tiles = kv.ahead + 2
    events = build_trace(s, TraceOptions(batch=8, kv_tokens=tiles * kv.tokens))
    key = kv.tile_buffers[0]
    layer0 = [e for e in events if e.where.startswith("layer 0 swa")]
    mine = [e for e in layer0 if getattr(e, "buffer", None) == key
            or getattr(e, "sem", (None,))[0] == key]
    kinds = [(type(e).__name__, e.where.removeprefix("layer 0 swa "),
              getattr(e, "tag", None) and e.tag.tile) for e in mine]
    assert kinds[0][:2] == ("Alloc", "at start"), kinds
    assert [k for k in kinds if k[0] == "CopyStart"][:kv.ahead] == [
        ("CopyStart", "at start", t) for t in range(kv.ahead)], kinds
    waits = [k[1] for k in kinds if k[0] == "CopyWait"]
    assert waits == ["kv_write"] * kv.ahead + ["attention"] * (tiles - kv.ahead), kinds
    assert [k[2] for k in kinds if k[0] == "Write"] == list(range(kv.ahead)), kinds
    assert [k[2] for k in kinds if k[0] == "Read"] == list(range(tiles)), kinds
    assert [k for k in kinds if k[0] == "CopyStart"][kv.ahead:] == [
        ("CopyStart", "attention", t) for t in range(kv.ahead, tiles)], kinds
    assert kinds[-1][0] == "Free" and not any(isinstance(e, (Alloc, Free)) and e.where.endswith("attention")
                                              for e in mine), kinds
    assert all(isinstance(e, (Alloc, CopyStart, CopyWait, Free, Read, Write)) for e in mine)


def test_kv_tiles_at_layer_start_written_before_their_copies_land_are_rejected(monkeypatch):
    """The checks read what the trace says `at layer start` does: a row write into the
    prefetched tiles without waiting their copies is a write under an in-flight copy."""
    from mkc import trace
    from mkc.tags import KvTile

    def write_without_waiting(self, k, layer, where):
        bufs, _, n_tiles = self._kv_tiles(k)
        for t in range(min(k.kv.ahead, n_tiles)):
            for b in bufs:
                self.tb.write(b.name, t % k.kv.slots, KvTile(layer, t), where, k.kv.span)

    monkeypatch.setattr(trace.StepTracer, "kv_landed", write_without_waiting)
    with pytest.raises(MkcError, match="kv_write writes swa_kv_key.* while a copy into it is in flight"):
        compiler.check_spec(ROOT / "schedules" / "muse_spark.sched")

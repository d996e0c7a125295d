"""The generic lowering's pieces: constants printed as literals that evaluate back to the same
values and scopes that pass exactly their live values (tests/families/test_conformance.py
checks every family's op registry complete)."""
import dataclasses

import pytest

from mkc import compiler
from mkc.codegen import generic
from mkc.codegen.layers import layer_source
from mkc.runtime.collectives import FromRows, GatherSums, ReduceScatter, Stage
from mkc.runtime.context import KindPlan, StateCopy
from mkc.runtime.experts import ExpertSlots
from mkc.runtime.kv import KvTiles
from mkc.runtime.ring import Ring, StreamedMatrix
from mkc.runtime.vectors import Parity
from tests_support import ROOT, SPEC, k3_scatter_text, qwen_scatter_text

NAMES = {c.__name__: c for c in (Stage, KindPlan, StateCopy, ExpertSlots, KvTiles, Ring,
                                 StreamedMatrix, Parity)}


@pytest.mark.parametrize("indent", [0, 20, 60])
def test_literals_evaluate_to_the_value_and_fit_the_line(indent):
    matrix = StreamedMatrix("in_proj", 5120, 2304, 5, 2, 1024, 1152)
    value = {"gdn": KindPlan(streamed={"in_proj": (0, matrix)},
                             states={"conv": "gdn_conv_buf"},
                             copies=(StateCopy("load", "gdn__conv", "gdn_conv_buf", 1),),
                             caches=("gqa__key",), kv=KvTiles(128, 2, 1)),
             "layers": tuple(range(200)), "single": (Stage("recv__bf16_8x1", 2, 8, 1),),
             "kinds": ("dense",) + ("kda", "kda", "kda", "mla") * 23 + ("kda",),
             "offsets": (0, 7) + tuple(range(19, 1039, 51)), "flags": (1, 0, 1, 1, 0, 0, 1, 0, 1),
             # a period that itself repeats inside (Muse Spark's layer pattern)
             "muse": (2, 1, 0, 1, 2, 1, 2, 1) * 15 + (2, 1, 0, 1)}
    text = generic.literal(value, indent)
    assert eval(text, dict(NAMES)) == value
    # continuation lines carry their indentation; the first starts at column `indent`
    assert max(indent * (i == 0) + len(line) for i, line in enumerate(text.splitlines())) <= generic.WIDTH
    # repeats print as such; fields at their default are left to the call
    assert "('kda', 'kda', 'kda', 'mla') * 23 + ('kda',)" in text
    assert "(2, 1, 0, 1, 2, 1, 2, 1) * 15 + (2, 1, 0, 1)" in text
    assert "tuple(range(19, 1039, 51))" in text and "(1, 0, 1, 1, 0, 0, 1, 0, 1)" in text
    assert "kv_rows=" not in text and "batch_axis=1" in text


def test_a_scope_returns_only_values_read_after_it():
    """In Qwen's gdn layer the conv buffer's scope (start to out_proj) defines h, proj, qkv,
    core and attn_out; h is defined again (post_norm) before any later read and the others are
    read only inside, so the scope returns attn_out only."""
    c = compiler.check_spec(ROOT / "schedules" / "qwen3_8_27b.sched", "qwen3_8_mini")
    src = layer_source(c.ir, "gdn")
    assert "        return attn_out,\n" in src
    assert "attn_out, = pl.run_scoped(" in src
    compile("def f(k, layer):\n    c = k\n    B = 1\n" + src, "layer", "exec")


def test_module_constants_are_the_runtime_dataclasses():
    c = compiler.compile_spec(ROOT / "schedules" / "qwen3_5_35b_a3b.sched", "qwen3_5_moe_mini")
    namespace: dict = {}
    exec(c.module_source, namespace)
    assert isinstance(namespace["EXPERTS"], ExpertSlots) and namespace["EXPERTS"].slots == 3
    assert set(namespace["KINDS"]) == {"gdn", "gqa", "moe"}
    assert dataclasses.is_dataclass(namespace["RING"])


def test_a_scattering_all_reduce_is_its_stages_by_rows_with_its_buffers_by_rows(tmp_path):
    """`scatter from 2 rows` on MINI Qwen: each all-reduce constant is a `FromRows` of the
    one-shot stages and the scattered ones (each stage's buffer and counter its own), and the
    scratch table gives each buffer, and its semaphores, to the kernels of the rows that use
    it; the send staging has neither semaphores nor a counter."""
    spec = tmp_path / SPEC.name
    spec.write_text(qwen_scatter_text())
    c = compiler.compile_spec(spec, "qwen3_8_mini")
    namespace: dict = {}
    exec(c.module_source, namespace)
    reduce = namespace["GQA_DOWN_REDUCE"]
    assert isinstance(reduce, FromRows) and reduce.rows == 2
    assert [type(st) for st in reduce.below] == [Stage, Stage]
    assert [type(st) for st in reduce.stages] == [ReduceScatter, Stage, GatherSums]
    rs, chunk, sums = reduce.stages
    assert (rs.buffer, rs.staging, rs.size, rs.stride) == ("scatter__bf16_2x1", "send__bf16_2x1", 2, 1)
    assert (chunk.buffer, chunk.size, chunk.stride) == ("chunk__bf16_4x2", 4, 2)
    assert (sums.buffer, sums.size) == ("sums__f32_2x1", 2)
    assert reduce.at(1) == reduce.below and reduce.at(2) == reduce.stages
    counters = [st.counter for st in (*reduce.below, *reduce.stages)]
    assert len(set(counters)) == len(counters) <= namespace["N_COLLECTIVE_COUNTERS"]
    host = namespace["HOST"]
    one, two = host.scratch_shapes(1), host.scratch_shapes(2)
    for name in ("recv_1to1__bf16_2x1", "recv_1to1__bf16_2x1__recv"):
        assert name in one and name not in two
    for name in ("scatter__bf16_2x1", "scatter__bf16_2x1__send", "send__bf16_2x1", "sums__f32_2x1"):
        assert name in two and name not in one
    assert not any(n.startswith("send__bf16_2x1__") for n in two)
    assert host.operand_names(2)[2] == list(two)


def test_scatter_at_every_width_is_the_scattered_stages_alone(tmp_path):
    spec = tmp_path / SPEC.name
    spec.write_text(qwen_scatter_text("scatter"))
    namespace: dict = {}
    exec(compiler.compile_spec(spec, "qwen3_8_mini").module_source, namespace)
    assert [type(st) for st in namespace["GDN_OUT_PROJ_REDUCE"]] == [ReduceScatter, Stage, GatherSums]
    assert not any(n.startswith("recv") for n in namespace["SCRATCH_SHAPES"])


def test_an_all_reduce_uses_each_span_of_widths_own_buffers(tmp_path):
    """K3 with `scatter from 8 rows` on every all-reduce: below 8 rows one-shot through the
    7168-column slots, from 8 scattered through the scattered form's (the routed experts'
    3584 columns in chunks padded to 512, within the 896 of the others')."""
    spec = tmp_path / "kimi_k3.sched"
    spec.write_text(k3_scatter_text())
    namespace: dict = {}
    exec(compiler.compile_spec(spec).module_source, namespace)
    routed = namespace["MOE_ROUTED_EXPERTS_REDUCE"]
    assert isinstance(routed, FromRows) and routed.rows == 8
    assert [st.buffer for st in routed.below] == ["recv_1to7__bf16_8x1", "recv_1to7__bf16_4x8"]
    assert [st.buffer for st in routed.stages] == ["scatter__bf16_8x1", "chunk__bf16_4x8",
                                                    "sums__f32_8x1"]
    shared = namespace["MOE_SHARED_DOWN_REDUCE"]
    assert shared.below == routed.below and type(shared.stages[0]) is ReduceScatter

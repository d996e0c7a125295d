"""The generic lowering's pieces: constants printed as literals that evaluate back to the same
values and scopes that pass exactly their live values (tests/families/test_conformance.py
checks every family's op registry complete)."""
import dataclasses

import pytest

from mkc import compiler
from mkc.codegen import generic
from mkc.codegen.layers import layer_source
from mkc.runtime.collectives import Stage
from mkc.runtime.context import KindPlan, StateCopy
from mkc.runtime.experts import ExpertSlots
from mkc.runtime.kv import KvTiles
from mkc.runtime.ring import Ring, StreamedMatrix
from mkc.runtime.vectors import Parity
from tests_support import ROOT

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
             "offsets": (0, 7) + tuple(range(19, 1039, 51)), "flags": (1, 0, 1, 1, 0, 0, 1, 0, 1)}
    text = generic.literal(value, indent)
    assert eval(text, dict(NAMES)) == value
    # continuation lines carry their indentation; the first starts at column `indent`
    assert max(indent * (i == 0) + len(line) for i, line in enumerate(text.splitlines())) <= generic.WIDTH
    # repeats print as such; fields at their default are left to the call
    assert "('kda', 'kda', 'kda', 'mla') * 23 + ('kda',)" in text
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

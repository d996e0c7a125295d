"""`mkc.resolve.collectives` on the scatter clause: which all-reduces scatter from which rows,
their chunk, and the buffers each form needs (by role, as wide as its widest payload, in the
kernels whose rows run that form)."""
import pytest

from mkc import ir
from mkc.lang.parser import parse
from mkc.resolve import resolve
from tests_support import K3_SPEC, SPEC, k3_scatter_text, k3_split_router_text, qwen_scatter_text


def _ir(text: str, path=K3_SPEC, model: str | None = None) -> ir.ScheduleIR:
    return resolve(parse(text, str(path)), model)


@pytest.fixture(scope="module")
def k3():
    return _ir(k3_scatter_text())


def _reduces(s: ir.ScheduleIR) -> dict[tuple[str, str], ir.AllReduce]:
    return {(k, a.after_op): a for k, ks in s.kinds.items() for a in ks.allreduces}


def test_the_clause_sets_the_rows_the_scattered_form_runs_from(k3):
    reduces = _reduces(k3)
    scattered = {key for key, a in reduces.items() if a.scatter_from is not None}
    assert scattered == {("kda", "o_proj"), ("mla", "o_proj"), ("dense", "down"),
                         ("moe", "shared_down"), ("moe", "routed_experts")}
    for key in scattered:
        a = reduces[key]
        assert a.scatter_from == 8 and a.stages == ((8, 1), (4, 8))
        assert not a.scattered(7) and a.scattered(8)
        # 7168 columns in chunks of 896; the routed experts' 3584 in 448 padded to 512
        assert a.chunk == (512 if key == ("moe", "routed_experts") else 896)
    # the embedding's reduce follows the first layer's all-reduce over the vocab group
    assert k3.embed_reduce.scatter_from == 8 and k3.embed_reduce.width == 7168


def test_each_form_has_its_own_buffers_in_the_kernels_that_run_it(k3):
    got = {b.name: (b.shape, b.dtype, b.rows) for b in k3.buffers if b.cls == "collective"
           and not b.name.startswith(("gather__", "exchange__"))}
    assert got == {
        # one-shot stages below 8 rows (every all-reduce there): 7168 columns
        "recv_1to7__bf16_8x1": ((2, 8, 8, 7168), "bf16", (1, 7)),
        "recv_1to7__bf16_4x8": ((2, 4, 8, 7168), "bf16", (1, 7)),
        # from 8 rows the scattered form: chunks of 7168 / 8 columns (the widest)
        "scatter__bf16_8x1": ((2, 8, 8, 896), "bf16", (8, 8)),
        "send__bf16_8x1": ((8, 8, 896), "bf16", (8, 8)),
        "chunk__bf16_4x8": ((2, 4, 8, 896), "bf16", (8, 8)),
        "sums__f32_8x1": ((2, 8, 8, 896), "f32", (8, 8)),
    }
    assert ir.is_staging("send__bf16_8x1") and not ir.is_staging("scatter__bf16_8x1")
    below = k3.buffer("recv_1to7__bf16_8x1")
    assert below.exists_at(1) and below.exists_at(7) and not below.exists_at(8)
    assert ir.row_spans(list(_reduces(k3).values()), k3.rows_max) == [(1, 7), (8, 8)]


def test_scatter_at_every_width_keeps_no_one_shot_form():
    s = _ir(k3_scatter_text("scatter"))
    assert {a.scatter_from for a in _reduces(s).values()} == {1}
    names = {b.name: b.rows for b in s.buffers if b.cls == "collective"}
    assert not any(n.startswith("recv") for n in names)
    assert names["scatter__bf16_8x1"] is None and names["sums__f32_8x1"] is None


def test_a_direct_all_reduce_scatters_over_its_one_group():
    """Qwen's 5120 columns over 8 ranks: a reduce-scatter in chunks of 640 and the all-gather,
    no later stage."""
    line = "allreduce o_proj, down two_level chip wire bf16\n"
    assert SPEC.read_text().count(line) == 1
    text = SPEC.read_text().replace(line, "allreduce o_proj, down direct wire bf16 scatter\n")
    s = _ir(text, SPEC)
    gqa = {a.after_op: a for a in s.kinds["gqa"].allreduces}
    assert gqa["o_proj"].stages == ((8, 1),) and gqa["o_proj"].chunk == 640
    names = {b.name for b in s.buffers if b.cls == "collective"}
    assert {"scatter__bf16_8x1", "send__bf16_8x1", "sums__f32_8x1"} <= names
    assert not any(n.startswith("chunk__") for n in names)


def test_the_mini_spec_scatters_a_chips_two_cores():
    s = _ir(qwen_scatter_text(), SPEC, "qwen3_8_mini")
    a = _reduces(s)["gqa", "down"]
    assert (a.stages, a.chunk, a.scatter_from) == (((2, 1), (4, 2)), 128, 2)



def test_nested_scatter_reduce_scatters_at_every_stage_and_gathers_back_in_its_dtype(k3):
    """K3's 7168 columns over the host's 8 ranks (896 each), then each 896-column chunk over
    the 4 hosts (224, padded to a lane tile: 256); the sums gathered back over each group in
    bf16; no one-shot stage left."""
    s = _ir(k3_scatter_text("scatter nested gather bf16 from 8 rows"))
    a = _reduces(s)["mla", "o_proj"]
    assert (a.nested, a.gather_dtype, a.scatter_from) == (True, "bf16", 8)
    assert a.scatter_stages() == ((8, 1, 896), (4, 8, 256))
    got = {b.name: (b.shape, b.dtype) for b in s.buffers if b.cls == "collective"
           and b.rows == (8, 8) and not b.name.startswith(("gather__", "exchange__"))}
    assert got == {
        "scatter__bf16_8x1": ((2, 8, 8, 896), "bf16"), "send__bf16_8x1": ((8, 8, 896), "bf16"),
        "sums__bf16_8x1": ((2, 8, 8, 896), "bf16"),
        "scatter__bf16_4x8": ((2, 4, 8, 256), "bf16"), "send__bf16_4x8": ((4, 8, 256), "bf16"),
        "sums__bf16_4x8": ((2, 4, 8, 256), "bf16"),
    }
    # the emulation rounds the result to bf16 in the kernels that gather it so
    from mkc.numerics import rounding_from_ir
    r = rounding_from_ir(s).reduce("mla", "o_proj")
    assert (r.gather, r.rounded_from) == ("bf16", 8)
    assert rounding_from_ir(k3).reduce("mla", "o_proj").rounded_from is None


def test_a_column_split_of_one_way_is_whole_and_needs_no_gather():
    """The shipped K3 spec keeps its router whole (`shard router over 1`), exchanging nothing;
    split over a chip's two cores, its logits need the sibling exchange the spec then names."""
    text = K3_SPEC.read_text()
    assert "shard router over 1\n" in text and "exchange router" not in text
    assert not _ir(text).kinds["moe"].exchanges
    with pytest.raises(Exception, match="moe.router leaves its output split 2 ways"):
        _ir(text.replace("shard router over 1\n", "shard router over chip\n"))
    split = _ir(k3_split_router_text())
    assert [e.after_op for e in split.kinds["moe"].exchanges] == ["router"]

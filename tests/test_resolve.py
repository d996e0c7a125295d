"""Resolving shard rules: classes split over a subgroup of the mesh and replicated across the
rest, the collective groups that follow from them, and hints that name only spellings that
work. And the resolve driver: a flat list of passes, each printable with `mkc ir --after`."""
import json
import re
from pathlib import Path

import pytest

from mkc.compiler import check_spec
from mkc.diagnostics import MkcError
from tests_support import ROOT, k3_format_text

SPEC16 = ROOT / "schedules" / "qwen3_8_27b_16.sched"
SPEC8 = ROOT / "schedules" / "qwen3_8_27b.sched"


def _variant(tmp_path: Path, text: str, *edits: tuple[str, str]) -> Path:
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "variant.sched"
    path.write_text(text)
    return path


def _error(path: Path, model: str | None = None):
    with pytest.raises(MkcError) as e:
        check_spec(path, model)
    return e.value.diagnostics[0]


@pytest.fixture(scope="module")
def qwen16():
    return check_spec(SPEC16).ir


def test_heads_over_8_of_16_ranks_replicate_attention(qwen16):
    s8 = check_spec(SPEC8).ir
    assert qwen16.shards == {"heads": (8, 1), "mlp": (16, 1), "vocab": (16, 1)}
    # attention is split as on 8 cores; the MLP and vocabulary twice as finely
    for name in ("nq", "nkv", "nk", "nv", "conv_ch"):
        assert qwen16.per_rank[name] == s8.per_rank[name], name
    assert qwen16.per_rank["inter"] * 2 == s8.per_rank["inter"]
    assert qwen16.per_rank["vocab"] * 2 == s8.per_rank["vocab"]
    rows = {(f.kind, f.name): (f.rows, f.cols) for fs in qwen16.stream.families.values() for f in fs}
    rows8 = {(f.kind, f.name): (f.rows, f.cols) for fs in s8.stream.families.values() for f in fs}
    assert rows["gqa", "qkv_gate"] == rows8["gqa", "qkv_gate"]
    assert rows["gdn", "down"][0] * 2 == rows8["gdn", "down"][0]
    # the HBM budget counts each rank's copy: the replicated attention weights stay per rank
    assert qwen16.hbm_bytes_per_rank["streamed weights"] < s8.hbm_bytes_per_rank["streamed weights"]


def test_all_reduces_run_within_each_partial_sums_group(qwen16):
    stages = {(k, a.after_op): a.stages for k, ks in qwen16.kinds.items() for a in ks.allreduces}
    # two_level chip: the sibling core, then the chips holding the other parts
    for kind, attention in (("gdn", "out_proj"), ("gqa", "o_proj")):
        assert stages[kind, attention] == ((2, 1), (4, 2))      # heads: 8 ranks
        assert stages[kind, "down"] == ((2, 1), (8, 2))         # mlp: all 16
    # the embedding's exact all-reduce spans the vocab group: it reuses the first layer's
    # (gdn) down stages
    assert qwen16.embed_reduce.stages == ((2, 1), (8, 2))


def test_strided_group_two_level_needs_a_level_holding_several_parts(tmp_path):
    """heads over tp / 2 on 16 ranks: parts on every other rank, so a chip's two cores hold the
    same part: two_level chip has no first level; two_level host does (4 of a host's 8)."""
    text = SPEC16.read_text().replace("shard heads over 8", "shard heads over tp / 2")
    d = _error(_variant(tmp_path, text))
    assert d.code == "E-COLLECTIVE" and "for out_proj" in d.message and "stride 2" in d.message
    assert "`direct`" in d.hint and "`two_level host`" in d.hint and "`two_level chip`" not in d.hint
    s = check_spec(_variant(tmp_path, text, ("two_level chip", "two_level host"))).ir
    stages = {(k, a.after_op): a.stages for k, ks in s.kinds.items() for a in ks.allreduces}
    assert stages["gdn", "out_proj"] == ((4, 2), (2, 8))
    assert stages["gdn", "down"] == ((8, 1), (2, 8))


def test_hint_lists_exactly_the_spellings_that_resolve(tmp_path):
    """24 heads over 16 ranks do not divide; the hint's spellings are the ones that resolve
    (tried one by one), and the other spellings of a group on this mesh do not."""
    text = SPEC16.read_text().replace("shard heads over 8", "shard heads over tp")
    d = _error(_variant(tmp_path, text))
    assert d.code == "E-SHARD" and "24 does not divide into 16 parts" in d.message
    m = re.search(r"write `shard heads over ([^`]+)`(?: \(or over ([^)]*)\))?", d.hint)
    assert m, d.hint
    offered = [m.group(1)] + (m.group(2).split(", ") if m.group(2) else [])
    assert offered[0] == "8"                        # the widest split first
    every = ["tp", "8", "4", "2", "tp / 2", "tp / 4", "tp / 8", "host", "chip"]
    assert set(offered) < set(every)
    for spelling in every:
        # direct all-reduces, so that the collective algorithm does not decide
        # and a small ring, so that VMEM does not either (more heads per rank need more)
        path = _variant(tmp_path, text, ("shard heads over tp", f"shard heads over {spelling}"),
                        ("two_level chip", "direct"),
                        ("7 slots of bf16 tiles up to 2048 x 1152",
                         "4 slots of bf16 tiles up to 1024 x 1024"),
                        ("stream weights ahead 7", "stream weights ahead 4"))
        try:
            check_spec(path)
            works = True
        except MkcError as e:
            assert e.diagnostics[0].code == "E-SHARD", e.diagnostics[0]
            works = False
        assert works == (spelling in offered), spelling


@pytest.mark.parametrize("target, fp8_operand", [("target v4 topology 2x2x2", False),
                                                 ("target  tpu7x topology 2x2x2", True)])
def test_a_format_records_whether_the_target_takes_fp8_operands(target, fp8_operand):
    """K3 MINI's FP8 experts on v4, whose Mosaic refuses an FP8 matmul operand (so its kernel
    converts the codes first), and on tpu7x (as shipped), which takes them (`mkc.target`)."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import k3_mini_text
    from mkc.lang.parser import parse
    from mkc.resolve import resolve
    text = re.sub(r"vmem\s+limit \d+ MiB reserve \d+ MiB", "vmem limit 16 MiB reserve 2 MiB",
                  k3_mini_text(k3_format_text("fp8 block")))
    s = resolve(parse(re.sub(r"target\s+tpu7x topology \S+", target, text)), "kimi_k3_mini")
    assert {f.name for f in s.weight_formats.values()} == {"fp8"}
    assert {f.fp8_operand for f in s.weight_formats.values()} == {fp8_operand}


def test_fp4_resolves_where_the_mxu_takes_it_and_is_refused_elsewhere():
    """The K3 spec with rounded FP4 experts resolves on tpu7x (the format line recorded for
    packing's diagnostics); moved to v4, whose MXU takes no FP4 operand, the format line is a
    diagnostic at the format name that names what v4 takes."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import k3_mini_text
    from mkc.lang.parser import parse
    from mkc.resolve import resolve
    text = re.sub(r"vmem\s+limit \d+ MiB reserve \d+ MiB", "vmem limit 16 MiB reserve 2 MiB",
                  k3_mini_text(k3_format_text("fp4 block")))
    s = resolve(parse(text, "kimi_k3.sched"), "kimi_k3_mini")
    assert {(f.name, f.rounded) for f in s.weight_formats.values()} == {("fp4", True)}
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "format expert.gate_up" in ln)
    assert s.weight_formats["expert.gate_up"].where == f"kimi_k3.sched:{line}"
    with pytest.raises(MkcError) as e:
        resolve(parse(re.sub(r"target\s+tpu7x topology \S+", "target v4 topology 2x2x2", text)),
                "kimi_k3_mini")
    [d] = e.value.diagnostics
    assert (d.code, d.span.line, d.span.column) == ("E-FORMAT", line, 25)
    assert "v4's matrix units take no fp4 operand" in d.message
    assert d.hint.startswith("on v4 expert.gate_up takes mxfp4, fp8;")


def test_every_offered_format_is_known_as_block_scaled_or_not():
    """`block N` is refused for a format that stores values unscaled; each family's formats are
    either block-scaled (`BLOCK_SCALED`) or bf16, so no new format slips through unjudged."""
    from mkc.model import registry
    from mkc.resolve.formats import BLOCK_SCALED
    offered = {x for family in registry.all_families()
               for _, formats in family.weight_formats for x in formats}
    assert offered and offered <= set(BLOCK_SCALED) | {"bf16"}, offered


# ---- the driver: a flat list of passes, and `mkc ir --after PASS` ----------------------------

MOE_SPEC = ROOT / "schedules" / "qwen3_5_35b_a3b.sched"     # pools and views: every pass adds


def test_the_driver_runs_each_pass_once_in_one_flat_list():
    """Every pass is a function of a pass module, none the driver's, run once, in order; the
    last one's IR is what `resolve` returns."""
    from mkc.lang.parser import parse_file
    from mkc.resolve import driver, resolve
    assert isinstance(driver.PASSES, tuple) and len(driver.PASSES) >= 10
    assert len(set(driver.PASS_NAMES)) == len(driver.PASS_NAMES)
    for p in driver.PASSES:
        assert callable(p.run) and p.run.__module__.startswith("mkc.resolve."), p
        assert p.run.__module__ != driver.__name__, p
    sched = parse_file(MOE_SPEC)[0]
    state = driver.run(sched)
    assert state.passes == driver.PASS_NAMES
    assert state.schedule_ir.to_json() == resolve(sched).to_json()
    assert driver.run(sched, after="pools").passes == driver.PASS_NAMES[:10]


def test_ir_after_each_pass_prints_what_it_resolved(capsys):
    """`mkc ir --after PASS`: the passes run up to PASS, and each pass adds to (or changes)
    what the one before it printed; after the last, the IR `mkc ir` prints."""
    from mkc.cli import main
    from mkc.resolve import PASS_NAMES
    before = {}
    for name in PASS_NAMES:
        assert main(["ir", str(MOE_SPEC), "--after", name]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc.pop("passes") == list(PASS_NAMES[:PASS_NAMES.index(name) + 1])
        assert doc != before, f"pass {name} resolved nothing"
        before = doc
    assert main(["ir", str(MOE_SPEC)]) == 0
    assert before["schedule_ir"] == json.loads(capsys.readouterr().out)


def test_ir_after_stops_before_a_later_pass_refuses_the_spec(capsys):
    from mkc.cli import main
    broken = ROOT / "tests" / "broken_specs" / "shard_not_divisible.sched"
    assert main(["ir", str(broken), "--after", "formats"]) == 0
    assert json.loads(capsys.readouterr().out)["passes"][-1] == "formats"
    assert main(["ir", str(broken), "--after", "graph"]) == 1
    assert "error[E-SHARD]" in capsys.readouterr().err


def test_ir_after_an_unknown_pass_is_a_usage_error_listing_the_passes(capsys):
    from mkc.cli import main
    from mkc.resolve import PASS_NAMES
    with pytest.raises(SystemExit) as e:
        main(["ir", str(SPEC8), "--after", "stream_tiles"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown resolve pass 'stream_tiles'" in err and "Traceback" not in err
    assert ", ".join(PASS_NAMES) in err


@pytest.mark.parametrize("line, code, column", [
    ("gqa: qkv_gate, o_proj, gate_up, down, down", "E-DUPLICATE", 43),     # repeated at the end
    ("gqa: qkv_gate, qkv_gate, o_proj, gate_up, down", "E-DUPLICATE", 20),  # repeated early
    ("gqa: qkv_gate, o_proj, gate_up", "E-STREAM", 28),                    # one left out
    ("gqa: qkv_gate, gate_up, o_proj, down", "E-STREAM-ORDER", 20),        # reordered
])
def test_a_stream_line_reports_its_first_wrong_item_where_it_is(tmp_path, line, code, column):
    """Each stream line is matched item by item against the layer's consumption order: the
    diagnostic sits on the item that is repeated, out of place, or after which names are
    missing."""
    d = _error(_variant(tmp_path, SPEC8.read_text(), ("gqa: qkv_gate, o_proj, gate_up, down", line)))
    assert (d.code, d.span.column) == (code, column), d


@pytest.mark.parametrize("tile, use", [("1024 x 0", "use 128"), ("1024 x 100", "use 128"),
                                        ("1024 x 700", "use 640 or 768")])
def test_an_unaligned_ring_tile_hint_names_positive_multiples(tmp_path, tile, use):
    d = _error(_variant(tmp_path, SPEC8.read_text(), ("up to 1024 x 768", f"up to {tile}")))
    assert d.code == "E-ALIGN" and d.hint.endswith(use), d.hint

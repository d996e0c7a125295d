"""`mkc retarget`: shipped specs derived for other slices pass every check with the targets asked
for; a slice without the HBM is one diagnostic naming a slice that works; a spec retargeted to
its own slice keeps its layout; the stale-comment rule it shares with `mkc tune`."""
import json

import pytest

from mkc import retarget
from mkc.cli import main
from mkc.compiler import check_source, check_spec
from mkc.diagnostics import MkcError
from mkc.lang import ast
from mkc.lang.parser import parse
from mkc.perf.comments import drop_stale_comments
from mkc.retarget.layout import carried_over, mesh_groups, spell
from mkc import target
from tests_support import ROOT

SCHEDULES = ROOT / "schedules"
# Each family's shipped spec with its MINI model (the quick tier) and its full model (slow).
FAMILIES = [("qwen3_8_27b", "qwen3_8_mini"), ("qwen3_5_35b_a3b", "qwen3_5_moe_mini"),
            ("kimi_k3", "kimi_k3_mini")]
# Slices of different shapes: another tpu7x size, a v6e 2-D slice, a v5p.
SLICES = ["tpu7x topology 2x2x2", "v6e topology 4x4", "v5p topology 2x2x4"]


def _plain(v):
    """A setting's value without spans."""
    if isinstance(v, (ast.Setting,)):
        return _plain(v.value)
    if isinstance(v, ast.Name):
        return v.text
    return tuple(map(_plain, v)) if isinstance(v, tuple) else v


def _layout(text: str, file: str) -> tuple:
    """What a spec means, names and comments aside: settings, rules and phase statements."""
    s = parse(text, file)
    settings = {k: _plain(v) for k, v in s.settings.items()}
    rules = [(r.dim.text, repr((r.group.name and r.group.name.text, r.group.divisor, r.group.ways)))
             for r in s.shards]
    phases = [(p.kind.text, [(a.algorithm.text, a.level and a.level.text, [o.text for o in a.ops])
                             for a in p.allreduces],
               [[o.text for o in g.ops] for g in p.allgathers + p.exchanges]) for p in s.phases]
    rings = [(r.slots, r.max_rows, r.max_cols) for r in s.rings]
    return settings, rules, phases, rings


def _retargeted(spec: str, slice_text: str, model: str | None, text: str | None = None):
    path = SCHEDULES / f"{spec}.sched"
    res = retarget.retarget(text or path.read_text(), str(path), slice_text, model, max_models=1)
    c = check_source(res.text, str(path), model)          # passes every check, as written
    return res, c.ir


@pytest.mark.parametrize("spec,mini", FAMILIES)
@pytest.mark.parametrize("slice_text", SLICES)
def test_each_family_retargets_to_slices_of_every_shape(spec, mini, slice_text):
    res, s = _retargeted(spec, slice_text, mini)
    gen, _, shape = slice_text.split()
    assert s.chip == gen and s.topology.endswith("=" + shape)
    assert s.ranks == target.topology(gen, tuple(int(d) for d in shape.split("x"))).num_cores
    assert s.name == f"{spec}_{gen}_{shape}"
    assert "modelled" in res.text.split("schedule")[0].lower()
    assert res.after.steps and all(t > 0 for t in res.after.steps.values())
    assert "+++" in res.diff() and f"target  {gen} topology {shape}" in res.text


# K3's MINI model has 16 heads, which its spec's 32 ranks do not divide: the retarget rightly
# changes that rule (the slow test below retargets the full-size K3 to its own slice).
@pytest.mark.parametrize("spec,mini", FAMILIES[:2])
def test_retargeting_to_the_own_slice_keeps_the_layout(spec, mini):
    path = SCHEDULES / f"{spec}.sched"
    gen, (grid, _) = parse(path.read_text(), str(path)).settings["target"].value
    own = f"{gen.text} topology {grid.text}"
    res = retarget.retarget(path.read_text(), str(path), own, mini)
    assert _layout(res.text, str(path)) == _layout(path.read_text(), str(path))


@pytest.mark.slow
def test_a_slice_short_of_hbm_is_one_diagnostic_naming_a_slice_that_works():
    path = SCHEDULES / "qwen3_8_27b.sched"
    with pytest.raises(MkcError) as e:
        retarget.retarget(path.read_text(), str(path), "v6e topology 1x1")
    [d] = e.value.diagnostics
    assert d.code == "E-RETARGET" and "HBM short by" in d.message and "GiB" in d.message
    assert d.span.line == 4                                  # the spec's target line
    assert "the nearest slice that works: `v6e topology 2x2`" in d.hint
    # docs/targets.md shows this diagnostic, figures and all
    assert f":{d.span.line}:{d.span.column}: error[{d.code}]: {d.message}\n" in \
        (ROOT / "docs" / "targets.md").read_text()
    # ... and that slice does work
    retarget.retarget(path.read_text(), str(path), "v6e topology 2x2", max_models=1)


@pytest.mark.parametrize("bad,word", [("v6e 4x8", "not a slice"), ("v9 topology 2x2", "v9"),
                                      ("v6e topology 3x3", "3x3"), ("v6e topology 2x2x1", "2")])
def test_a_bad_target_is_a_located_diagnostic(bad, word):
    with pytest.raises(MkcError) as e:
        retarget.parse_target(bad)
    [d] = e.value.diagnostics
    assert d.code == "E-TARGET" and word in d.message and d.span.file == "--target"


@pytest.mark.parametrize("bad", ["tpu7x topology " + "9" * 5000 + "x1x1",
                                 "tpu7x topology 2x2x" + "1" * 13,
                                 "tpu7x topology " + "x".join(["1"] * 50_000)])
def test_a_target_with_a_huge_number_is_a_range_error_not_a_traceback(bad):
    """Its numbers are bounded as a spec's are, before any conversion to int (Python refuses
    integers of over 4300 digits)."""
    with pytest.raises(MkcError) as e:
        retarget.parse_target(bad)
    [d] = e.value.diagnostics
    assert d.code == "E-RANGE" and d.span.file == "--target"
    assert "digits" in d.message or "dimensions" in d.message


def test_a_target_in_non_ascii_digits_is_not_a_slice():
    with pytest.raises(MkcError) as e:
        retarget.parse_target("tpu7x topology \u0662x\u0662x\u0661")   # Arabic-Indic 2x2x1
    assert e.value.diagnostics[0].code == "E-TARGET"


@pytest.mark.parametrize("models", ["0", "-1", "x", "9" * 5000])
def test_models_must_be_a_positive_count(models, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["retarget", str(SCHEDULES / "qwen3_8_27b.sched"), "--target", "v6e topology 2x4",
              "-o", str(tmp_path / "r.sched"), "--models", models])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --models: expected an integer of at least 1" in err and "Traceback" not in err


def test_groups_carry_over_by_meaning():
    topo = target.topology("v6e", (4, 8))          # 32 ranks, 4 a host, 1 a chip
    g = parse((SCHEDULES / "kimi_k3.sched").read_text()).shards
    by = {r.dim.text: r.group for r in g}
    assert carried_over(by["heads"], "tp", topo) == (32, 1)
    assert carried_over(by["experts"], "tp", topo) == (8, 4)
    assert carried_over(by["latent_up"], "tp", topo) == (4, 1)
    assert carried_over(by["router"], "tp", topo) == (1, 1)
    assert spell((4, 1), "tp", topo, "host") == "host" and spell((4, 1), "tp", topo) == "4"
    assert spell((8, 4), "tp", topo) == "tp / 4" and spell((32, 1), "tp", topo, "32") == "tp"
    groups = mesh_groups(32)
    assert groups[0] == (32, 1) and (1, 1) in groups and (8, 4) in groups
    assert [w for w, _ in groups] == sorted((w for w, _ in groups), reverse=True)


def test_a_scatter_clause_stays_its_chunks_padded_to_whole_lane_tiles():
    """K3's `scatter` clauses: moved with its MINI config (512 hidden columns over a host's 8
    cores: chunks of 64) each clause stays, its chunks padded to a lane tile; the algorithm
    and the shared-expert sum's `overlap` stay too."""
    shipped = (SCHEDULES / "kimi_k3.sched").read_text()
    assert shipped.count("wire bf16 scatter from 8 rows") == 4
    assert shipped.count("shared_down two_level host wire bf16 scatter overlap") == 1
    res, s = _retargeted("kimi_k3", "tpu7x topology 2x2x2", "kimi_k3_mini")
    assert res.text.count("allreduce o_proj two_level host wire bf16 scatter from 8 rows\n") == 2
    assert "allreduce shared_down two_level host wire bf16 scatter overlap\n" in res.text
    scattered = {a.after_op: a for k in s.kinds.values() for a in k.allreduces
                 if a.scatter_from is not None}
    assert set(scattered) == {"o_proj", "down", "shared_down", "routed_experts"}
    assert {a.chunk for a in scattered.values()} == {128}
    assert all(a.width < 8 * 128 for a in scattered.values())
    assert [a.after_op for k in s.kinds.values() for a in k.allreduces if a.overlap] == ["shared_down"]


def test_k3_rules_on_a_one_core_chip_slice_need_no_sibling():
    """v6e chips are one rank: the router's `chip` rule and sibling exchange must go. Every
    generation takes the shipped MXFP4 experts; v6e's MXU takes no FP4 operand, so the rounded
    FP4 blocks variant's become FP8 blocks (not rounded: exact where packing accepts them)."""
    from tests_support import k3_format_text
    res, s = _retargeted("kimi_k3", "v6e topology 4x8", "kimi_k3_mini")
    assert "with sibling" not in res.text and s.chip == "v6e"
    assert not any(k.exchanges for k in s.kinds.values())
    assert "  format expert.gate_up mxfp4\n  format expert.down mxfp4\n" in res.text
    assert {f.name for f in s.weight_formats.values()} == {"mxfp4"}
    res, s = _retargeted("kimi_k3", "v6e topology 4x8", "kimi_k3_mini", k3_format_text("fp4 block"))
    assert "  format expert.gate_up fp8 block 512\n  format expert.down fp8 block 128\n" in res.text
    assert {f.name for f in s.weight_formats.values()} == {"fp8"}


def test_cli_writes_only_a_checked_spec(tmp_path, capsys):
    out = tmp_path / "q_v6e.sched"
    spec = str(SCHEDULES / "qwen3_8_27b.sched")
    assert main(["retarget", spec, "--model", "qwen3_8_mini", "--target", "v6e topology 2x4",
                 "-o", str(out), "--json", "--models", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "ok" and doc["retarget"]["modelled"]
    assert doc["retarget"]["to"] == "v6e topology 2x4" and "+++" in doc["retarget"]["diff"]
    check_spec(out, "qwen3_8_mini")
    assert "schedule q_v6e {" in out.read_text()
    bad = tmp_path / "never.sched"
    assert main(["retarget", spec, "--target", "v6e 2x4", "-o", str(bad)]) == 1
    assert "E-TARGET" in capsys.readouterr().err and not bad.exists()
    assert main(["retarget", spec, "--target", "v6e topology 2x4", "-o", spec]) == 1


def test_stale_comments_of_changed_statements_go():
    text = "\n".join([
        "schedule s {",
        "  # Explains the rules, no figures.",
        "  shard heads over tp",
        "  shard mlp over tp",
        "",
        "  # Eight slots: 12.5 MiB at batch 8.",
        "  ring weights: 8 slots of bf16 tiles up to 1024 x 1024  # two ahead",
        "  pool p {",
        "    view a: 2 slots of expert",
        "  }",
        "}"])
    out = drop_stale_comments(text, {4: None, 7: "# `mkc tune`: ring 8 -> 6"})
    assert "# Explains the rules" in out                        # no number: kept
    assert "Eight slots" not in out and "# two ahead" not in out
    assert "  # `mkc tune`: ring 8 -> 6\n  ring weights" in out
    # A statement inside a pool owns the comment above the pool's header.
    text2 = text.replace("  pool p {", "  # Two expert slots.\n  pool p {")
    assert "Two expert slots" not in drop_stale_comments(text2, {10: None})
    assert drop_stale_comments(text, {}) == text
    # A long note wraps at the width, at the indent of the comment it replaces (the pool's).
    note = "# `mkc tune`: " + "placement of moe (pool view or ring weights) " * 4
    out = drop_stale_comments(text2, {10: note}).split("\n")
    at = out.index("  pool p {")
    wrapped = out[next(i for i, ln in enumerate(out) if "`mkc tune`" in ln):at]
    assert len(wrapped) > 1 and all(ln.startswith("  # ") and len(ln) <= 96 for ln in wrapped)
    assert " ".join(ln.removeprefix("  # ") for ln in wrapped) == note.removeprefix("# ").strip()


# CI retargets each family once, to another generation each; the extended tier the rest.
IN_CI_RETARGETS = {("qwen3_8_27b", "v6e topology 8x16"), ("qwen3_5_35b_a3b", "v5p topology 2x4x4"),
                   ("kimi_k3", "tpu7x topology 2x2x8")}
# Each family's first spec keeps its layout in CI; the layouts derived from one, extended.
IN_CI_OWN_SLICE = {"qwen3_8_27b", "qwen3_5_35b_a3b", "kimi_k3", "gpt_oss_120b", "llama_3_1_8b",
                   "qwen3_30b_a3b"}


def _tier(case, in_ci: bool):
    return pytest.param(*case if isinstance(case, tuple) else (case,),
                        marks=pytest.mark.slow if in_ci else pytest.mark.extended)


@pytest.mark.parametrize("spec, slice_text", [
    _tier((spec, slice_text), (spec, slice_text) in IN_CI_RETARGETS)
    for slice_text in ("tpu7x topology 2x2x8", "v6e topology 8x16", "v5p topology 2x4x4")
    for spec in ("qwen3_8_27b", "qwen3_5_35b_a3b", "kimi_k3")])
def test_full_size_families_retarget(spec, slice_text):
    res, s = _retargeted(spec, slice_text, None)
    assert s.chip == slice_text.split()[0] and res.after.steps


@pytest.mark.parametrize("spec", [_tier(p.stem, p.stem in IN_CI_OWN_SLICE)
                                  for p in sorted(SCHEDULES.glob("*.sched"))])
def test_full_size_retarget_to_own_slice_keeps_the_layout(spec):
    path = SCHEDULES / f"{spec}.sched"
    s = parse(path.read_text(), str(path))
    gen, (grid, _) = s.settings["target"].value
    res = retarget.retarget(path.read_text(), str(path), f"{gen.text} topology {grid.text}")
    assert _layout(res.text, str(path)) == _layout(path.read_text(), str(path))


def test_fit_shrinks_vmem_until_the_specs_own_headroom_promise_holds():
    """A candidate that fits but leaves less VMEM than its `expect vmem headroom` promises is
    shrunk like one over the budget (K3 retargeted to 64 ranks, under the measured-scratch
    bound, left 0.36 of its promised 1 MiB)."""
    import importlib
    fit = importlib.import_module("mkc.retarget.fit")
    text = (ROOT / "schedules" / "qwen3_8_27b.sched").read_text().replace(
        "expect vmem headroom at least 1 MiB", "expect vmem headroom at least 30 MiB")
    checked = fit.fit(text, "promise.sched", None)
    assert any(n.startswith("VMEM: ") for n in checked.notes), checked.notes
    assert "expect vmem headroom at least 30 MiB" in checked.text


def test_every_candidate_has_a_verdict_and_more_vmem_suggests_tune(tmp_path, capsys):
    """tpu7x -> v6e (twice the VMEM a core): each of the 4 candidates says what became of it
    (two are the same spec as an earlier one), the old slice's figures leave the comments the
    retarget keeps, and the output suggests `mkc tune`. The shipped spec's all-reduces go direct
    here (its two_level chip ones are already over hosts on v6e, one core a chip), so that the
    candidate summing over hosts in two levels is a spec of its own."""
    out = tmp_path / "q_v6e.sched"
    text = (SCHEDULES / "qwen3_8_27b.sched").read_text()
    assert text.count(" two_level chip wire bf16\n") == 2
    spec = tmp_path / "qwen3_8_27b.sched"
    spec.write_text(text.replace(" two_level chip wire bf16\n", " direct wire bf16\n"))
    assert main(["retarget", str(spec), "--model", "qwen3_8_mini", "--target", "v6e topology 2x4",
                 "-o", str(out), "--models", "1"]) == 0
    printed = capsys.readouterr().out
    verdicts = [line for line in printed.splitlines() if line.startswith("  candidate ")]
    assert [v.split(",")[0] for v in verdicts] == [f"  candidate {i} of 4" for i in range(1, 5)]
    assert "candidate 1 of 4, the spec's rules: passes: B1 " in verdicts[0]
    assert "not modelled (only the first 1 that pass are: --models)" in verdicts[1]
    assert all("skipped: " in v and "so it is candidate" in v for v in verdicts[2:])
    assert "the widest rules: skipped: its shard rules come out as the earlier" in verdicts[2]
    assert "next: v6e has 128 MiB of VMEM a core, tpu7x 64 MiB" in printed and "`mkc tune`" in printed
    text = out.read_text()
    for stale in ("46.6 MiB", "-5.2 %", "-0.4 %", "-1.9 %"):
        assert stale not in text
    # what the comments say beside their figures stays
    assert "# one or two sequences per launch: 16 rows fit.\n  verify" in text
    assert "# boundaries and into the lm_head. 19 tiles of at most 1024 x 768 in flight.\n  ring" in text


def test_no_tune_advice_on_a_chip_with_no_more_vmem():
    assert retarget.vmem_advice(target.chip("v6e"), target.chip("tpu7x"),
                                retarget.Slice("tpu7x", (2, 2, 1))) == []
    assert retarget.vmem_advice(target.chip("tpu7x"), target.chip("tpu7x"),
                                retarget.Slice("tpu7x", (2, 2, 2))) == []


def test_old_figures_leave_comments_by_parenthesis_sentence_or_whole():
    from mkc.retarget.comments import drop_old_figures
    text = "\n".join([
        "# 2.160 ms modelled. Kept note.",
        "schedule s {",
        "  # Four tiles in flight (32 of 128 tokens; modelled -0.5 % step). Two are",
        "  # enough: the third waits. 1 anchor + 7 drafts.",
        "  kv tiles 4 slots of 128 tokens ahead 4  # 12.5 MiB",
        "  # 43.9 MiB of VMEM at batch 16.",
        "  batch 1 to 8  # two ahead",
        "}"])
    out = drop_old_figures(text, keep_above=2).split("\n")
    assert out == [
        "# 2.160 ms modelled. Kept note.",           # the tool's own note, above `schedule`
        "schedule s {",
        "  # Four tiles in flight. Two are enough: the third waits. 1 anchor + 7",   # re-wrapped
        "  # drafts.",
        "  kv tiles 4 slots of 128 tokens ahead 4",
        "  batch 1 to 8  # two ahead",
        "}"]

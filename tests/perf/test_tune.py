"""`mkc tune`: knobs found from the AST and edited in place; coordinate descent on a tiny space
with a known optimum; the written spec re-parses, passes every check, differs from the input
only inside the tokens of the settings it changed (comments and layout kept), and is not slower
(modelled)."""
import difflib
import json
import re
from types import SimpleNamespace

import pytest

from mkc.cli import main
from mkc.compiler import check_spec
from mkc.lang.parser import parse
from mkc.perf import tune
from tests_support import SPEC

MINI = "qwen3_8_mini"
_ALL_TOKENS = re.compile(r"#[^\n]*|\s+|\w+|\S")


def _tokens(text):
    return [(m.group(), m.start(), m.end()) for m in _ALL_TOKENS.finditer(text)]


def _changed_only_inside(before, after, ranges):
    """Every token of `before` that differs in `after` lies inside one of `ranges`, and no
    comment or line break changed."""
    a, b = _tokens(before), _tokens(after)
    sm = difflib.SequenceMatcher(None, [t[0] for t in a], [t[0] for t in b], autojunk=False)
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op == "equal":
            continue
        for tok, start, end in a[i1:i2]:
            assert any(lo <= start and end <= hi for lo, hi in ranges), (tok, start)
        for tok, _, _ in a[i1:i2] + b[j1:j2]:
            assert not tok.startswith("#") and "\n" not in tok, tok


def test_knobs_edit_only_their_tokens():
    text = SPEC.read_text()
    s = tune.check_text(text, str(SPEC), MINI)
    knobs = tune.find_knobs(parse(text, str(SPEC)), tune.SpecSource(text), s)
    names = {k.name for k in knobs}
    assert {"ring weights slots / stream ahead", "ring weights tile bound", "kv tiles of gqa",
            "allreduce out_proj, down in gdn", "allreduce o_proj, down in gqa"} <= names
    for k in knobs:
        assert [text[sl.start:sl.end] for sl in k.slots] == list(k.render(k.value)), k.name
        assert k.value not in k.neighbours(k.value)
    config = tuple(k.neighbours(k.value)[0] for k in knobs)
    edited = tune.render(text, knobs, config)
    parse(edited, str(SPEC))
    _changed_only_inside(text, edited, [(sl.start, sl.end) for k in knobs for sl in k.slots])
    assert tune.render(text, knobs, tuple(k.value for k in knobs)) == text


def test_the_algorithm_knob_tries_the_scatter_clause():
    """Each all-reduce's algorithm knob: the algorithm and the scatter clause after the wire
    dtype, one-shot, at every width or from the widest kernel's rows (16: the verify step's),
    rendered in place and back."""
    text = SPEC.read_text()
    s = tune.check_text(text, str(SPEC), MINI)
    knob = next(k for k in tune.find_knobs(parse(text, str(SPEC)), tune.SpecSource(text), s)
                if k.name == "allreduce o_proj, down in gqa")
    assert knob.value == ("direct", "")
    assert {("direct", " scatter"), ("direct", " scatter from 16 rows"),
            ("two_level chip", " scatter from 16 rows")} <= set(knob.neighbours(knob.value))
    edited = tune.render(text, [knob], (("two_level chip", " scatter from 16 rows"),))
    assert "allreduce o_proj, down two_level chip wire bf16 scatter from 16 rows\n" in edited
    tune.check_text(edited, str(SPEC), MINI)        # chunks of 128 over a chip's 2 cores
    back = next(k for k in tune.find_knobs(parse(edited, str(SPEC)), tune.SpecSource(edited), s)
                if k.name == knob.name)
    assert back.value == ("two_level chip", " scatter from 16 rows")
    assert [edited[sl.start:sl.end] for sl in back.slots] == list(back.value)
    assert tune.render(edited, [back], (("direct", ""),)) == text


def test_coordinate_descent_finds_the_optimum_of_a_tiny_space(monkeypatch):
    """A fake step time with its minimum at ring 7 slots, ahead 7, KV tiles of 256 tokens: the
    search reaches it through candidates that all pass the real checks."""
    def fake_step(s, batch, tokens, keep_timeline=False, **priced_by):
        kv = s.kinds["gqa"].kv
        t = abs(s.stream.slots - 7) + abs(s.stream.ahead - 7) + (kv.tokens != 256) + batch
        return SimpleNamespace(step_s=t * 1e-3)

    monkeypatch.setattr(tune, "step_model", fake_step)
    res = tune.tune(SPEC.read_text(), str(SPEC), MINI, budget=40,
                    select=lambda k: k.name in ("ring weights slots / stream ahead",
                                                "kv tiles of gqa"))
    assert res.evaluations <= 40
    changed = {k.name: new for k, _, new in res.changed()}
    assert changed["ring weights slots / stream ahead"] == (7, 7)
    assert changed["kv tiles of gqa"][1] == 256
    assert res.best.steps == {1: 1e-3, 8: 8e-3}
    assert res.history and res.rejected <= res.evaluations


def test_tune_cli_writes_a_checked_spec_not_slower(tmp_path, capsys):
    out = tmp_path / "tuned.sched"
    assert main(["tune", str(SPEC), "--model", MINI, "-o", str(out), "--budget", "12",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    t = doc["tune"]
    assert doc["verdict"] == "ok" and t["modelled"] and t["evaluations"] <= 12
    before, after = t["before_step_seconds"], t["after_step_seconds"]
    assert set(before) == {"1", "8"}
    assert sum(after.values()) <= sum(before.values())
    text, tuned = SPEC.read_text(), out.read_text()
    check_spec(out, MINI)                                # re-parses and passes every check
    # Comments: the input's, less those of changed statements that state numbers, plus one
    # note per changed statement (mkc.perf.comments).
    notes = [ln.strip() for ln in tuned.splitlines() if ln.strip().startswith("# `mkc tune`:")]
    assert all(ln.strip() in text or ln.strip() in notes
               for ln in tuned.splitlines() if ln.strip().startswith("#"))
    assert len(notes) == len({c["line"] for c in t["changed"]})
    assert all(c["setting"] in " ".join(notes) for c in t["changed"])
    # Statements: only the changed settings' tokens differ.
    strip = [ln.split("#")[0].rstrip() for ln in text.splitlines() if not ln.strip().startswith("#")]
    strip_t = [ln.split("#")[0].rstrip() for ln in tuned.splitlines()
               if not ln.strip().startswith("#")]
    assert len(strip) == len(strip_t)
    changed_lines = {c["line"] for c in t["changed"]}
    for i, (a, b) in enumerate(zip(strip, strip_t)):
        if a != b:        # a changed statement: a knob's line or its stream's header
            assert any(0 <= i - line_index(text, ln) <= 1 for ln in changed_lines), (a, b)
    assert sum(a != b for a, b in zip(strip, strip_t)) <= 2 * len(t["changed"])
    assert (tuned != text) == bool(t["changed"])
    headroom = t["headroom_bytes"]
    assert set(headroom) == {"1", "8", "16"}                # batches 1, 8 and 16 verify rows
    assert min(headroom.values()) >= t["min_headroom_bytes"] == 1 << 20


def test_a_candidate_short_of_the_headroom_margin_is_refused():
    """A margin no candidate meets: every change is refused, the input is kept (the baseline),
    and the table names the margin and the headroom at every kernel width."""
    res = tune.tune(SPEC.read_text(), str(SPEC), MINI, budget=5, min_headroom=1 << 40)
    assert not res.changed() and res.best is res.before
    assert res.short_of_headroom == res.evaluations - 1 >= 1
    assert set(res.best.headroom) == {1, 8, 16}
    table = tune.table(res, "x")
    assert "1048576.00 MiB" in table and "16 rows" in table and "less than the margin" in table


def test_a_changed_statement_gets_a_note_in_place_of_its_numbered_comment():
    text = SPEC.read_text()
    res = tune.tune(text, str(SPEC), MINI, budget=2,
                    select=lambda k: k.name == "kv tiles of gqa")
    knob = res.knobs[0]
    config = (knob.neighbours(knob.value)[0],)        # a change, as if the search kept it
    res.best = tune.Evaluation(config, tune.render(text, res.knobs, config), ok=True,
                               steps=res.before.steps, headroom=res.before.headroom)
    out = res.text
    assert "Four KV tiles of each cache in flight" in text
    assert "Four KV tiles of each cache in flight" not in out      # stated the old numbers
    assert "# `mkc tune`: kv tiles of gqa 4 slots of 128 tokens ahead 4 ->" in out
    assert "The conv state lives from the layer start" in out   # another statement's


def line_index(text: str, line: int) -> int:
    """The index of 1-based `line` among the statement lines (comment-only lines left out)."""
    return sum(1 for ln in text.splitlines()[:line - 1] if not ln.strip().startswith("#"))


def test_tune_text_output_has_the_table(tmp_path, capsys):
    out = tmp_path / "t.sched"
    assert main(["tune", str(SPEC), "--model", MINI, "-o", str(out), "--budget", "3"]) == 0
    text = capsys.readouterr().out
    assert "3 evaluations" in text and "modelled" in text and f"wrote {out}" in text
    assert "before ms" in text and "after tok/s" in text
    with pytest.raises(SystemExit) as e:                       # a usage error
        main(["tune", str(SPEC), "-o", str(out), "--budget", "0"])
    assert e.value.code == 2 and "--budget: expected an integer of at least 1" in capsys.readouterr().err
    assert main(["tune", str(SPEC), "-o", str(SPEC)]) == 1     # never over its input
    assert "E-TUNE" in capsys.readouterr().err


@pytest.mark.slow
def test_tune_runs_on_the_gpt_oss_120b_spec_and_its_kv_ring(tmp_path, capsys):
    """GPT-OSS (issue 22): the spec it writes keeps the sliding layers' `kv ring`, passes
    every check and is not slower (modelled)."""
    from tests_support import ROOT
    spec = ROOT / "schedules" / "gpt_oss_120b.sched"
    out = tmp_path / "tuned.sched"
    assert main(["tune", str(spec), "-o", str(out), "--budget", "3", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)["tune"]
    assert t["evaluations"] <= 3 and set(t["before_step_seconds"]) == {"1", "8"}
    assert sum(t["after_step_seconds"].values()) <= sum(t["before_step_seconds"].values())
    assert "kv ring 256 slots" in out.read_text()
    check_spec(out)

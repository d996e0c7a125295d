"""The recorded validation: nothing fitted, the model's error at every published step, and that
the shipped model (the calibration spec's shipped compiled measures) still reproduces what was
recorded (rerun benchmarks/validate_perf.py after a model change)."""
import json

import pytest

from mkc.compiler import check_spec
from mkc.perf import constants
from mkc.perf.run import compiled_measure, step_model, validation_note
from tests_support import ROOT


@pytest.fixture(scope="module")
def recorded():
    return (constants.validation("tpu7x"),
            json.loads((constants.DATA / "published_points.json").read_text()))


def test_nothing_is_fitted(recorded):
    val, _ = recorded
    data = constants.load_data("tpu7x")
    assert val["fitted"] == [] and "latency_scale" not in data["constants"]
    assert not any(c["source"].startswith("fitted") for c in data["constants"].values())


def test_the_recorded_errors_are_what_the_model_gives_now(recorded):
    """Each published step (batch 1, batch 8, the verify step of 8 rows) modelled on the
    calibration spec at the published runs' context, priced by its shipped compiled measures."""
    val, inputs = recorded
    s = check_spec(ROOT / inputs["spec"], inputs["model"]).ir
    rates, traces = constants.rates("tpu7x"), {}
    assert [p["step_s"] for p in inputs["steps"]] == [p["published_step_s"] for p in val["points"]]
    assert val["tokens_in_cache"] == inputs["tokens_in_cache"]
    for p in val["points"]:
        seqs = p["sequences"]
        got = step_model(s, p["batch"], inputs["tokens_in_cache"], rates, keep_timeline=False,
                         traces=traces, sequences=seqs,
                         compiled=compiled_measure(s, p["batch"], seqs)).step_s
        assert got == pytest.approx(p["modelled_step_s"], rel=1e-4), (
            f"{p['step']}: the model changed; rerun benchmarks/validate_perf.py")
        assert 100 * (p["modelled_step_s"] / p["published_step_s"] - 1) == pytest.approx(
            p["error_percent"], abs=0.01)
        assert f"{p['step']} {p['published_step_s'] * 1e3:.2f} ms published" in \
            validation_note("tpu7x")


def test_each_assumed_constant_s_sensitivity_spans_its_range(recorded):
    """Moving an assumed constant across its range moves the steps it touches one way: the
    recorded ends bracket the step at its value."""
    val, _ = recorded
    at_value = {f"kimi_k3 (calibration) B{p['batch']}": p["modelled_step_s"] * 1e3
                for p in val["points"] if not p["sequences"]}
    for name, row in val["sensitivity"].items():
        for label, (lo, hi) in row["steps_ms"].items():
            if label in at_value:
                assert min(lo, hi) * (1 - 1e-3) <= at_value[label] <= max(lo, hi) * (1 + 1e-3), (
                    name, label)


def _validate_perf():
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import validate_perf
    return validate_perf


def test_the_hold_out_is_recorded_as_published(recorded):
    """Muse Spark's 12 published steps and batch-1 phases are what the record holds, each
    error its published and modelled steps' ratio, at the published runs' cache and routing."""
    val, inputs = recorded
    hold, rec = inputs["hold_out"], val["hold_out"]
    assert (rec["spec"], rec["tokens_in_cache"], rec["routing"]) == (
        hold["spec"], hold["tokens_in_cache"], hold["routing"])
    assert len(hold["steps"]) == 12 and [(p["weights"], p["batch"], p["step_s"]) for p in
                                          hold["steps"]] == [
        (p["weights"], p["batch"], p["published_step_s"]) for p in rec["points"]]
    for p in rec["points"]:
        assert 100 * (p["modelled_step_s"] / p["published_step_s"] - 1) == pytest.approx(
            p["error_percent"], abs=0.01)
    assert [(p["phase"], p["s"]) for p in hold["phases"]["published"]] == [
        (p["phase"], p["s"]) for p in rec["phases"] if p["phase"] != "other"]


def test_each_hold_out_weight_set_is_its_format_lines_on_the_calibration_spec(recorded):
    """NVFP4 + bf16 dense is the spec as written; int8 dense adds a channel format line for
    each dense class; int4 rewrites the experts' lines on the bf16 checkpoint's model."""
    vp = _validate_perf()
    hold = recorded[1]["hold_out"]
    formats = {w["name"]: vp.weight_set_ir(hold, w["name"]) for w in hold["weight_sets"]}
    text = (ROOT / hold["spec"]).read_text()
    assert vp.weight_set_text(text, {}) == text
    assert {c: (f.name, f.block) for c, f in formats["nvfp4_bf16"].weight_formats.items()} == {
        "expert.gate_up": ("nvfp4", 16), "expert.down": ("nvfp4", 16)}
    int8 = formats["nvfp4_int8"].weight_formats
    assert all(int8[c].name == "int8" and int8[c].channel for c in ("attention", "latent",
                                                                     "lm_head"))
    int4 = formats["int4_bf16"]
    assert int4.model == "muse_spark" and {
        (f.name, f.block) for f in int4.weight_formats.values()} == {("int4", 128)}


def test_the_hold_out_sums_the_experts_over_chips_first_from_batch_8(recorded):
    """The hand kernel's expert all-reduce is hierarchical from batch 8 only: the calibration
    spec's reduce-scatter + all-gather below, two-level over chips from 8 rows."""
    vp = _validate_perf()
    hold = recorded[1]["hold_out"]

    def expert_sum(batch):
        moe = vp.weight_set_ir(hold, "int4_bf16", batch).kinds["moe"]
        return next(a for a in moe.allreduces if a.after_op == "routed_experts")

    assert (expert_sum(4).algorithm, expert_sum(8).algorithm) == ("direct", "two_level")


@pytest.mark.extended
def test_the_hold_out_s_recorded_steps_and_phases_are_what_the_model_gives_now(
        recorded, monkeypatch):
    """Every Muse Spark step priced afresh per op (each op body compiled alone: minutes in a
    fresh cache) is the recorded one, and the batch-1 phases add up to the modelled step."""
    monkeypatch.setenv("MKC_OP_COMPILE", "1")
    vp = _validate_perf()
    val, inputs = recorded
    hold = inputs["hold_out"]
    for p in val["hold_out"]["points"]:
        c_ir = vp.weight_set_ir(hold, p["weights"], p["batch"])
        got = vp.hold_out_step(c_ir, p["batch"], hold).step_s
        assert got == pytest.approx(p["modelled_step_s"], rel=1e-4), (
            f"{p['weights']} B{p['batch']}: the model changed; rerun benchmarks/validate_perf.py")
    c_ir = vp.weight_set_ir(hold, hold["phases"]["weights"], hold["phases"]["batch"])
    res = vp.hold_out_step(c_ir, hold["phases"]["batch"], hold)
    phases = vp.step_phases(c_ir, res)
    assert sum(phases.values()) == pytest.approx(res.step_s, rel=1e-9)
    assert phases["other"] >= 0
    layers = len(c_ir.layer_kinds) // 2
    for p in val["hold_out"]["phases"]:
        per = layers if p["per"] == "layer" else 1
        assert phases[p["phase"]] / per == pytest.approx(p["modelled_s"], rel=1e-3), p["phase"]

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

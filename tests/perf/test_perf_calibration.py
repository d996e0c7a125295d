"""The recorded calibration: one fitted constant within its bounds, its residuals at the
published points, the hold-outs, and that the shipped model (the calibration spec's shipped
compiled measures) still reproduces what was recorded (rerun benchmarks/calibrate_perf.py after
a model change)."""
import json

import pytest

from mkc.compiler import check_spec
from mkc.perf import constants
from mkc.perf.run import calibration_note, compiled_measure, step_model
from tests_support import ROOT

AIM_PERCENT = 10.0


@pytest.fixture(scope="module")
def recorded():
    cal = constants.calibration("tpu7x")
    inputs = json.loads((constants.DATA / "calibration_points.json").read_text())
    return cal, inputs


@pytest.fixture(scope="module")
def steps(recorded):
    """The calibration spec's step at (batch, sequences) for a value of the fitted constant,
    priced by its shipped compiled measures (no compile)."""
    cal, inputs = recorded
    s = check_spec(ROOT / inputs["spec"], inputs["model"]).ir
    traces: dict = {}

    def step(batch: int, value: float, sequences: int | None = None) -> float:
        rates = constants.rates("tpu7x", {cal["fitted"][0]: value})
        return step_model(s, batch, inputs["tokens_in_cache"], rates, keep_timeline=False,
                          traces=traces, sequences=sequences,
                          compiled=compiled_measure(s, batch, sequences)).step_s
    return step


def test_one_constant_is_fitted_within_its_physical_bounds(recorded):
    cal, inputs = recorded
    data = constants.load_data("tpu7x")
    fitted = [n for n, c in data["constants"].items() if c["source"].startswith("fitted")]
    assert fitted == cal["fitted"] == inputs["fit"] == ["latency_scale"]
    lo, hi = inputs["bounds"]["latency_scale"]
    assert lo >= 0.5 and hi <= 2.0 and cal["bounds"] == [lo, hi]
    assert lo <= data["constants"]["latency_scale"]["value"] == cal["values"]["latency_scale"] <= hi
    for name, c in data["constants"].items():
        assert c["source"].split(":")[0].split()[0] in ("published", "assumed", "fitted"), name
    assert "mxu_feed_scale" not in data["constants"]       # the feed rate is derived, not fitted


def test_the_residuals_at_the_published_points_are_within_the_aim(recorded):
    cal, inputs = recorded
    assert [p["batch"] for p in cal["points"]] == [p["batch"] for p in inputs["points"]] == [1, 8]
    for p, src in zip(cal["points"], inputs["points"]):
        assert p["published_step_s"] == src["step_s"]
        assert 100 * (p["modelled_step_s"] / p["published_step_s"] - 1) == pytest.approx(
            p["error_percent"], abs=0.01)
        assert abs(p["error_percent"]) <= AIM_PERCENT


def test_the_model_reproduces_the_recorded_fit_and_its_hold_outs(recorded, steps):
    """The recorded steps are what the shipped model gives: the fit's, each point predicted
    from the other, and the speculative step (never fitted), within 10 % of its published
    time (issue 32)."""
    cal, inputs = recorded
    value = cal["values"]["latency_scale"]
    for p in cal["points"]:
        assert steps(p["batch"], value) == pytest.approx(p["modelled_step_s"], rel=1e-4), (
            f"batch {p['batch']}: the model changed since the fit; rerun "
            "benchmarks/calibrate_perf.py")
    assert {p["batch"] for p in cal["leave_one_out"]} == {1, 8}
    for p in cal["leave_one_out"]:
        assert steps(p["batch"], p["latency_scale"]) == pytest.approx(p["modelled_step_s"],
                                                                       rel=1e-4)
    h, got = inputs["speculative_holdout"], cal["speculative_holdout"]
    assert h["step_s"] not in {p["step_s"] for p in inputs["points"]}      # not a fitted point
    assert (got["rows"], got["sequences"], got["published_step_s"]) == (
        h["rows"], h["sequences"], h["step_s"])
    assert steps(h["rows"] * h["sequences"], value, h["sequences"]) == pytest.approx(
        got["modelled_step_s"], rel=1e-4)
    assert abs(got["error_percent"]) <= AIM_PERCENT
    assert f"speculative step of {h['rows']} rows" in calibration_note("tpu7x")


def test_the_dma_queue_sweep_covers_the_chosen_count(recorded):
    cal, inputs = recorded
    sweep = {row["dma_queues"]: row for row in cal["dma_queues_sweep"]}
    assert set(sweep) == set(inputs["dma_queues_sweep"])
    chosen = constants.rates("tpu7x").dma_queues
    assert sweep[chosen]["latency_scale"] == pytest.approx(cal["values"]["latency_scale"],
                                                           rel=1e-3)

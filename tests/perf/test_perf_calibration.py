"""The recorded calibration: its error at the published points, and that the shipped model
still reproduces what was recorded (rerun benchmarks/calibrate_perf.py after a model change)."""
import json

import pytest

from mkc.compiler import check_spec
from mkc.perf import constants
from mkc.perf.run import step_model
from tests_support import ROOT

AIM_PERCENT = 15.0


@pytest.fixture(scope="module")
def recorded():
    cal = constants.calibration("tpu7x")
    inputs = json.loads((constants.DATA / "calibration_points.json").read_text())
    return cal, inputs


def test_recorded_fit_is_within_the_aim_at_both_published_points(recorded):
    cal, inputs = recorded
    assert {p["batch"] for p in cal["points"]} == {p["batch"] for p in inputs["points"]} == {1, 8}
    for p, src in zip(cal["points"], inputs["points"]):
        assert p["published_step_s"] == src["step_s"]
        assert abs(p["modelled_step_s"] / p["published_step_s"] - 1) * 100 == pytest.approx(
            abs(p["error_percent"]), abs=0.01)
        assert abs(p["error_percent"]) <= AIM_PERCENT


def test_fitted_constants_say_where_they_came_from(recorded):
    cal, _ = recorded
    data = constants.load_data("tpu7x")
    for name, c in data["constants"].items():
        assert c["source"].split(":")[0].split()[0] in ("published", "assumed", "fitted"), name
    for name in cal["fitted"]:
        assert data["constants"][name]["source"].startswith("fitted"), name


def test_the_model_reproduces_the_recorded_fit(recorded):
    """The model at the recorded constants gives the recorded steps: the fit's, or, while the
    fit is blocked, the ones recorded with the reason (which `mkc perf` prints)."""
    cal, inputs = recorded
    c = check_spec(ROOT / inputs["spec"], inputs["model"])
    assert ("blocked" in cal) == ("blocked" in inputs)
    for p in (cal["blocked"] if "blocked" in cal else cal)["points"]:
        got = step_model(c.ir, p["batch"], inputs["tokens_in_cache"], keep_timeline=False).step_s
        assert got == pytest.approx(p["modelled_step_s"], rel=1e-4), (
            f"batch {p['batch']}: the model changed since the fit; rerun "
            "benchmarks/calibrate_perf.py")


def test_the_hold_out_is_recorded_and_reproduced(recorded):
    """Fit on batch 8 alone (the feed rate; the latencies at their assumed level), predict
    batch 1: recorded with its error, which the model still gives. Not held to the aim: it is
    what the model predicts, reported as it is."""
    cal, inputs = recorded
    ho = cal["holdout"]
    assert ho["on"] == inputs["holdout"]["on"] == [8] and ho["fit"] == inputs["holdout"]["fit"]
    roles = {p["batch"]: p["role"] for p in ho["points"]}
    assert roles == {8: "fitted", 1: "predicted"}
    if "blocked" in cal:
        pytest.skip(f"the fit is blocked, its hold-out was made under the earlier model: "
                    f"{cal['blocked']['reason'][:120]}...")
    c = check_spec(ROOT / inputs["spec"], inputs["model"])
    rates = constants.rates("tpu7x", ho["fixed"]).replace(**ho["values"])
    for p in ho["points"]:
        got = step_model(c.ir, p["batch"], inputs["tokens_in_cache"], rates,
                         keep_timeline=False).step_s
        assert got == pytest.approx(p["modelled_step_s"], rel=1e-4)
        assert 100 * (got / p["published_step_s"] - 1) == pytest.approx(p["error_percent"],
                                                                          abs=0.01)
    # The fitted point is met, or the fit stopped at a bound (the record says which value).
    at_bound = any(v in inputs["bounds"][n] for n, v in ho["values"].items())
    assert at_bound or abs(next(p for p in ho["points"] if p["role"] == "fitted")["error_percent"]) < 0.1


def test_the_dma_queue_sweep_covers_the_chosen_count(recorded):
    cal, inputs = recorded
    sweep = {row["dma_queues"]: row for row in cal["dma_queues_sweep"]}
    assert set(sweep) == set(inputs["dma_queues_sweep"])
    chosen = constants.rates("tpu7x").dma_queues
    assert cal["dma_queues"] == chosen and chosen in sweep
    row = sweep[chosen]
    for name in cal["fitted"]:
        assert row["fit"][name] == pytest.approx(constants.rates("tpu7x").__getattribute__(name),
                                                 rel=1e-4)
    for row in sweep.values():
        assert all(abs(e) < 0.1 for e in row["fit_error_percent"])


def test_the_speculative_step_is_a_hold_out_never_fitted(recorded):
    """The hand kernel's speculative step (8 rows, ~8.5 ms) is not a calibration point: the
    record reports the model's verify step of those rows beside it, which the model still
    gives, and `mkc perf` prints it. Fitted, the model predicts it within 10 % (issue 18)."""
    cal, inputs = recorded
    h = inputs["speculative_holdout"]
    assert h["step_s"] not in {p["step_s"] for p in inputs["points"]}      # not a fitted point
    got = (cal["blocked"] if "blocked" in cal else cal)["speculative_holdout"]
    if "blocked" not in cal:
        assert abs(got["error_percent"]) <= 10
    assert (got["rows"], got["sequences"], got["published_step_s"]) == (h["rows"], h["sequences"],
                                                                       h["step_s"])
    c = check_spec(ROOT / inputs["spec"], inputs["model"])
    step = step_model(c.ir, h["rows"] * h["sequences"], inputs["tokens_in_cache"],
                      keep_timeline=False, sequences=h["sequences"]).step_s
    assert step == pytest.approx(got["modelled_step_s"], rel=1e-4)
    from mkc.perf.run import calibration_note
    assert f"speculative step of {h['rows']} rows" in calibration_note("tpu7x")


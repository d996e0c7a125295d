"""The step-time model on every generation mkc compiles for: a generation's data file gives
what is published for it (ICI) and carries every other constant, fitted ones too, from tpu7x,
saying so in each source and in the report ("unvalidated on v6e")."""
import json

import pytest

from mkc import target
from mkc.cli import main
from mkc.perf import constants
from tests_support import ROOT

V6E_SPEC = ROOT / "schedules" / "qwen3_8_27b_v6e.sched"
TPU7X_SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"


@pytest.mark.parametrize("chip", [c for c in target.known_chips() if c != "tpu7x"])
def test_every_generation_has_rates_whose_borrowed_constants_say_so(chip):
    rates = constants.rates(chip)
    own = constants.load_data(chip)["own"]
    assert constants.carried_from(chip) == "tpu7x" and constants.validation(chip) == {}
    assert {"ici_link_bytes_per_s", "ici_chip_bytes_per_s"} <= set(own)
    for name in ("ici_copy_s", "hbm_efficiency"):
        assert rates.provenance[name].startswith(f"carried from tpu7x (not measured on {chip})")
        assert getattr(rates, name) == constants.rates("tpu7x").__getattribute__(name)
    for name in own:
        assert rates.provenance[name].startswith("published")
    # a rank's HBM bandwidth is the one the HBM floor uses (megacore included)
    assert rates.hbm_bytes_per_s == target.chip(chip).hbm_bytes_per_s
    assert rates.ici_link_bytes_per_s <= rates.ici_chip_bytes_per_s


def _perf(spec, capsys, *args) -> dict:
    assert main(["perf", str(spec), "--json", "--batch", "1", *args]) == 0
    return json.loads(capsys.readouterr().out)["perf"]


def test_v6e_step_is_labelled_unvalidated_and_follows_its_bandwidth(capsys):
    """The same Qwen 27B layout on 8 v6e chips and on 8 tpu7x cores streams the same bytes per
    rank; both are weight-streaming bound, so the modelled steps scale with the per-rank HBM
    bandwidth (1.64 against 3.7 TB/s), and neither beats its HBM floor."""
    v6e, tpu7x = _perf(V6E_SPEC, capsys), _perf(TPU7X_SPEC, capsys)
    assert v6e["validation"].startswith("unvalidated on v6e:")
    assert "carried from tpu7x" in v6e["validation"]
    assert tpu7x["validation"].startswith("validated, nothing fitted:")
    for rep in (v6e, tpu7x):
        assert rep["step_seconds"] >= rep["hbm_floor_seconds"]
    bandwidth = target.chip("tpu7x").hbm_bytes_per_s / target.chip("v6e").hbm_bytes_per_s
    assert v6e["step_seconds"] / tpu7x["step_seconds"] == pytest.approx(bandwidth, rel=0.15)


def test_tune_runs_on_a_2d_torus(tmp_path, capsys):
    """v5e/v6e grids have two dimensions (the tuner once read a third)."""
    out = tmp_path / "tuned.sched"
    assert main(["tune", str(V6E_SPEC), "-o", str(out), "--budget", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tune"]["evaluations"] == 3 and out.is_file()

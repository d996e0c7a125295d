"""`mkc perf`: text and JSON, every time labelled modelled, bad input as diagnostics."""
import json
from pathlib import Path

import pytest

from mkc.cli import main
from mkc.compiler import check_spec
from tests_support import ROOT, SPEC


@pytest.fixture
def no_op_measures(tmp_path, monkeypatch):
    """No op measured (shipped or cached): an unshipped kernel is counted (tests compile no op
    alone: MKC_OP_COMPILE=0)."""
    from mkc.perf import op_measures
    monkeypatch.setattr(op_measures, "DATA", tmp_path / "shipped_ops")
    monkeypatch.setenv("MKC_OP_CACHE", str(tmp_path / "ops"))


def test_perf_text_is_labelled_modelled_with_breakdown_and_stalls(capsys, no_op_measures):
    assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "modelled, not measured" in out and "modelled step:" in out
    assert "% of the HBM floor" in out and "tok/s (modelled)" in out
    assert "validated, nothing fitted:" in out
    assert "costliest ops (modelled compute over the step, counted from the emitted kernel)" in out
    for cause in ("weight streaming", "exposed compute", "stalls", "collectives",
                  "prologue/epilogue"):
        assert cause in out
    for kind in ("gdn", "gqa", "prologue", "epilogue"):
        assert f"\n  {kind} " in out
    assert "largest stalls" in out and "qwen3_8_27b.sched:" in out


def test_perf_json_breakdown_adds_up(capsys):
    assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--batch", "8", "--context",
                 "1024", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "ok" and doc["command"] == "perf"
    perf = doc["perf"]
    assert perf["modelled"] is True and perf["batch"] == 8 and perf["tokens_in_cache"] == 1024
    step = perf["step_seconds"]
    assert abs(sum(perf["by_cause_seconds"].values()) - step) < 1e-9 * max(1, step * 1e9)
    assert abs(sum(sum(v.values()) for v in perf["by_kind_seconds"].values()) - step) < 1e-9
    assert perf["tokens_per_s"] == 8 / step
    assert 0 < perf["percent_of_hbm_floor"] <= 100
    for st in perf["stalls"]:
        assert st["line"] > 0 and st["file"].endswith(".sched") and st["seconds"] > 0
    assert all("source" in c for c in perf["constants"].values())


def test_perf_on_a_bad_spec_is_a_diagnostic(capsys):
    bad = ROOT / "tests" / "broken_specs" / "double_wait.sched"
    assert main(["perf", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "error[E-DMA-WAIT]" in err and "Traceback" not in err
    assert main(["perf", str(bad), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "error" and doc["diagnostics"][0]["code"] == "E-DMA-WAIT"


def test_perf_batch_outside_the_spec_is_a_diagnostic(capsys):
    assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--batch", "9"]) == 1
    err = capsys.readouterr().err
    assert "error[E-PERF]" in err and "--batch 9" in err
    with pytest.raises(SystemExit) as e:        # a usage error, before any spec is read
        main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--context", "-1", "--json"])
    assert e.value.code == 2 and "--context" in capsys.readouterr().err


def test_perf_verify_models_one_launch_of_rows_over_fewer_caches(capsys):
    """A verify step of 8 rows streams the weights once, like a decode step of 8 rows, but reads
    one sequence's KV cache and state (not 8): modelled between batch 1 and batch 8, and its
    tok/s counts the accepted tokens."""
    def perf(*args: str) -> dict:
        assert main(["perf", str(SPEC), "--json", *args]) == 0
        return json.loads(capsys.readouterr().out)["perf"]
    one, eight = perf("--batch", "1"), perf("--batch", "8")
    verify = perf("--verify", "8", "--acceptance", "6")
    assert verify["verify"] == {"rows": 8, "sequences": 1, "acceptance": 6}
    assert verify["batch"] == 8
    assert one["step_seconds"] < verify["step_seconds"] < eight["step_seconds"]
    assert verify["hbm_floor_seconds"] < eight["hbm_floor_seconds"]
    assert verify["tokens_per_s"] == 6 / verify["step_seconds"]


def test_perf_verify_the_spec_does_not_build_is_a_diagnostic(capsys):
    assert main(["perf", str(SPEC), "--verify", "9"]) == 1
    err = capsys.readouterr().err
    assert "E-PERF" in err and "--verify 9 is not a verify step this spec builds (up to 8 rows)" in err
    assert main(["perf", str(SPEC), "--verify", "8", "--batch", "3"]) == 1
    assert "--batch 3 sequences is outside the spec's verify sequences (1 to 2)" in capsys.readouterr().err


def test_perf_acceptance_without_verify_is_a_diagnostic(capsys):
    assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--acceptance", "3"]) == 1
    assert "--acceptance 3 needs --verify R" in capsys.readouterr().err


def test_perf_outputs_that_are_not_regular_files_are_refused_before_the_model_runs(tmp_path, capsys):
    """A trace or picture path naming a directory or device is an E-IO diagnostic up front;
    the atomic write never renames over it (as root that would replace /dev/null)."""
    for flag in ("--trace", "--plot"):
        assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", flag, "/dev/null"]) == 1
        out, err = capsys.readouterr()
        assert f"error[E-IO]: {flag} /dev/null is not a regular file mkc may write" in err
        assert "modelled step" not in out
    assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--plot", str(tmp_path)]) == 1
    assert tmp_path.is_dir()
    assert Path("/dev/null").is_char_device()


def test_perf_plot_with_a_suffix_mkc_does_not_draw_is_a_diagnostic(tmp_path, capsys):
    out = tmp_path / "step.foo"
    assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--plot", str(out)]) == 1
    assert "mkc draws .png, .svg, .pdf files" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _seed_bundles(tmp_path, monkeypatch, rows: list[dict]) -> None:
    """A bundle measure of qwen3_8_27b's decode kernel at batch 1, in a private user cache, as
    `mkc perf --bundles` would have written it (so no compile runs)."""
    from mkc.codegen.emit import render
    from mkc.compiler import check_spec
    from mkc.perf import bundles
    monkeypatch.setenv("MKC_BUNDLE_CACHE", str(tmp_path))
    monkeypatch.setattr(bundles, "DATA", tmp_path / "none")
    s = check_spec(SPEC).ir
    key = bundles.cache_key(render(s, ""), "decode", 1, bundles.libtpu_version())
    row = {"bundles": 10.0, "cycles": 100.0, "per_iteration": 0.0, "read_cycles": 0.0, "reads": 0,
           "spec_line": 0, "group": "op", "slots": {"vpu": 12.0}, "bound": "dependencies",
           "busiest": 0.1, "run_time_loops": 0,
           "hottest": {"first": 16, "last": 17, "trips": 1, "depth": 1, "bundles": ["vadd.f32"]}}
    bundles.save({"schema": bundles.SCHEMA, "key": key, "spec": s.name, "chip": s.chip,
                  "topology": s.topology, "kernel": "decode", "batch": 1, "verify_rows": None,
                  "libtpu": bundles.libtpu_version(), "bundles": 20, "slot_capacity": {},
                  "layer_loop": True, "calls": bundles.layer_calls(s), "compile_seconds": 0.0,
                  "rows": [row | r for r in rows]})


def test_bundle_report_reads_the_cache_and_names_rows(tmp_path, monkeypatch, capsys):
    _seed_bundles(tmp_path, monkeypatch, [
        {"key": "gdn.in_proj", "kind": "gdn", "name": "in_proj", "cycles": 8000.0},
        {"key": "gqa.attention", "kind": "gqa", "name": "attention", "per_iteration": 50.0}])
    assert main(["perf", str(SPEC), "--bundles", "--batch", "1", "--op", "gdn.in_proj"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("gdn.in_proj "))
    assert row[:4] == ["gdn.in_proj", "48", "8,000", "0"] and "hottest region" in out
    assert main(["perf", str(SPEC), "--bundles", "--batch", "1", "--op", "gdn.inproj"]) == 1
    err = capsys.readouterr()
    assert "did you mean 'gdn.in_proj'" in err.out + err.err
    assert main(["perf", str(SPEC), "--op", "gdn.in_proj"]) == 1
    err = capsys.readouterr()
    assert "--op needs --bundles" in err.out + err.err
    assert main(["perf", str(SPEC), "--bundles", "--batch", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["key"] for r in doc["bundles"]["rows"]] == ["gdn.in_proj", "gqa.attention"]


def test_compiled_price_names_each_op_s_source(tmp_path, monkeypatch, capsys):
    _seed_bundles(tmp_path, monkeypatch, [
        {"key": "gdn.in_proj", "kind": "gdn", "name": "in_proj", "cycles": 8000.0}])
    assert main(["perf", str(SPEC), "--compiled", "--batch", "1", "--json"]) == 0
    perf = json.loads(capsys.readouterr().out)["perf"]
    assert perf["priced_by"].startswith("compiled: the cycles libtpu")
    sources = {(e["layer_kind"], e["op"]): e["source"] for e in perf["op_costs"]}
    assert sources["gdn", "in_proj"].startswith("compiled: row gdn.in_proj of libtpu")
    assert sources["gqa", "attention"].startswith("counted: the compiled kernel has no row")
    assert perf["constants"]["ici_copy_s"]["source"].startswith("measured: ")
    # its verdict and its trace are of the step priced as compiled, not a counted one
    assert perf["verdict"]["hbm_efficiency"] == perf["constants"]["hbm_efficiency"]["value"]
    trace = tmp_path / "step.json"
    assert main(["perf", str(SPEC), "--compiled", "--batch", "1", "--json", "--trace",
                 str(trace)]) == 0
    step = json.loads(capsys.readouterr().out)["perf"]["step_seconds"]
    assert json.loads(trace.read_text())["otherData"]["step_us"] == pytest.approx(step * 1e6,
                                                                                 abs=1e-3)
    for flag in ("--compiled", "--bundles"):           # one check, at the spec's verify line
        assert main(["perf", str(SPEC), flag, "--verify", "3"]) == 1
        err = capsys.readouterr()
        said = err.out + err.err
        assert "E-BUNDLES" in said and "pass --verify 8" in said and ".sched:9:3:" in said


def test_a_kernel_libtpu_does_not_compile_is_a_diagnostic_at_the_target_line(tmp_path, monkeypatch,
                                                                            capsys):
    """--bundles and --compiled on a kernel with no measure whose compile fails (a generation
    this libtpu lacks, a Mosaic error): E-BUNDLES at the spec's target line, with what to run
    instead; the default price counts it and says why."""
    from mkc.perf import bundles

    def refuse(s, kernel, batch, **kw):
        raise bundles.BundleError(f"libtpu did not compile the {kernel} kernel of {s.name} for "
                                  f"{s.topology}: no such generation")
    from mkc.perf import op_measures
    monkeypatch.setattr(bundles, "measure", refuse)
    monkeypatch.setattr(bundles, "DATA", tmp_path / "shipped")
    monkeypatch.setattr(op_measures, "DATA", tmp_path / "shipped_ops")   # no op measured either
    monkeypatch.setenv("MKC_BUNDLE_CACHE", str(tmp_path / "cache"))
    for flag, hint in (("--bundles", "without --bundles"), ("--compiled", "--counted")):
        assert main(["perf", str(SPEC), flag, "--batch", "1"]) == 1
        err = capsys.readouterr()
        said = err.out + err.err
        assert "E-BUNDLES" in said and "libtpu did not compile the decode kernel" in said
        assert ".sched:4:3:" in said and hint in said, said
    assert main(["perf", str(SPEC), "--batch", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["perf"]["priced_by"].startswith("counted:")


def test_the_step_is_priced_as_compiled_where_a_measure_is_shipped_and_counted_elsewhere(
        capsys, no_op_measures):
    """By default no compile: a shipped spec's kernels are priced by their shipped measures; a
    kernel without one (another model, a verify width the module does not build) is counted
    and says why; --counted counts a shipped one too."""
    def priced(*args: str) -> str:
        assert main(["perf", *args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["perf"]["priced_by"]
    assert priced(str(SPEC), "--batch", "1").startswith("compiled: the cycles libtpu")
    mini = priced(str(SPEC), "--model", "qwen3_8_mini", "--batch", "1")
    assert mini.startswith("counted:") and "no bundles measured" in mini
    assert "(--compiled compiles it)" in mini and "MKC_OP_COMPILE=0" in mini   # tests: off
    verify = priced(str(SPEC), "--verify", "3")
    assert verify.startswith("counted:") and "pass --verify 8" in verify
    assert priced(str(SPEC), "--batch", "1", "--counted") == (
        "counted: the traced kernel's work at the chip's rates (mkc.perf.work; the MXUs "
        "loading weights at their push rate), asked for (--counted)")
    with pytest.raises(SystemExit) as e:                    # one or the other
        main(["perf", str(SPEC), "--counted", "--compiled"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_perf_verdict_says_what_bounds_the_step_against_the_model_s_own_ceiling(capsys):
    """Qwen 3.8 27B at batch 1 streams its weights within 10 % of what the model lets any step
    reach (peak x hbm_efficiency), so the verdict says only fewer bytes help and which bytes;
    the MINI model at batch 1 is far from its ceiling and says what bounds it instead."""
    assert main(["perf", str(SPEC), "--batch", "1", "--context", "1024", "--json"]) == 0
    perf = json.loads(capsys.readouterr().out)["perf"]
    v = perf["verdict"]
    eff = perf["constants"]["hbm_efficiency"]["value"]
    assert v["bound_by"] == "HBM streaming" and "only fewer bytes help" in v["text"]
    assert v["hbm_efficiency"] == eff and v["percent_of_hbm_ceiling"] > 90
    assert v["percent_of_hbm_ceiling"] == pytest.approx(perf["percent_of_hbm_floor"] / eff,
                                                        rel=1e-6)
    assert v["hbm_ceiling_seconds"] == pytest.approx(perf["hbm_floor_seconds"] / eff, rel=1e-6)
    by_class = {c["class"]: c["bytes"] for c in v["hbm_bytes_by_class"]}
    assert next(iter(by_class)) == "weights"
    assert set(by_class) <= {"weights", "kv cache", "state (load + store)", "vectors"}
    peak = perf["constants"]["hbm_bytes_per_s"]["value"]
    assert sum(by_class.values()) / peak == pytest.approx(perf["hbm_floor_seconds"], rel=1e-9)
    assert main(["perf", str(SPEC), "--batch", "1", "--context", "1024"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3] == f"verdict: {v['text']}"          # beside the step, before the tables
    assert f"at {v['percent_of_hbm_ceiling']:.1f}% of the model's HBM ceiling" in lines[3]
    assert "bytes by class (this core, a step): weights " in lines[3]

    assert main(["perf", str(SPEC), "--model", "qwen3_8_mini", "--batch", "1", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)["perf"]["verdict"]
    assert v["bound_by"] != "HBM streaming" and v["percent_of_hbm_ceiling"] < 90
    assert v["seconds_above_ceiling"] > 0 and f"bound by {v['bound_by']}" in v["text"]


def test_the_verdict_says_hbm_streaming_exactly_within_its_90_percent_threshold():
    """docs/perf.md: within 90 % of the model's HBM ceiling a step is bound by HBM streaming;
    otherwise the verdict names the other cause that takes the most time. Kimi K3 at batch 8
    models at ~88 % of its ceiling with streaming its largest cause: that is not "only fewer
    bytes help". The same step's figures, its time moved across the threshold."""
    from dataclasses import replace

    from mkc.perf.run import HBM_BOUND_SHARE, model, verdict
    m = model(check_spec(SPEC).ir, 8, 1024)
    ceiling = verdict(m)["hbm_ceiling_seconds"]
    for share in (0.62, 0.88, HBM_BOUND_SHARE, 0.97):
        step = ceiling / share
        causes = {c: 0.0 for c in m.res.by_cause}
        causes.update({"weight streaming": 0.7 * step, "stalls": 0.2 * step,
                       "collectives": 0.1 * step})
        v = verdict(replace(m, res=replace(m.res, step_s=step, by_cause=causes)))
        assert v["percent_of_hbm_ceiling"] == pytest.approx(100 * share)
        if share >= HBM_BOUND_SHARE:
            assert v["bound_by"] == "HBM streaming" and "only fewer bytes help" in v["text"]
        else:
            assert v["bound_by"] == "stalls" and "only fewer bytes help" not in v["text"]
            assert v["seconds_above_ceiling"] == pytest.approx(step - ceiling)


def test_one_stall_total_in_the_text_the_picture_and_the_trace():
    """A stall is every wait that blocked compute, the epilogue's included, and the text, the
    picture and the trace give one figure for it: the expectation over routing in the text (the
    picture's title and the trace's otherData repeat it) and, for the one routed step they
    draw, the picture's stall row and the trace's stall slices (the text names it too)."""
    from mkc import target
    from mkc.perf.perfetto import trace_events
    from mkc.perf.plot import figure
    from mkc.perf.run import model, report, table
    from mkc.perf.sim import CAUSES
    s = check_spec(ROOT / "schedules" / "qwen3_5_35b_a3b.sched").ir
    m = model(s, 8, 1024, keep_timeline=True)
    rep = report(m)
    expected, pictured = rep["stall_seconds"], rep["pictured_step"]["stall_seconds"]
    assert any(st["kind"] == "epilogue" for st in rep["stalls"])
    assert rep["by_cause_seconds"]["stalls"] == expected
    assert sum(st["seconds"] for st in rep["stalls"]) == pytest.approx(expected, rel=1e-12)
    text = table(rep)
    total = next(line for line in text.splitlines() if line.startswith("  total "))
    assert total.split()[1 + CAUSES.index("stalls")] == f"{expected * 1e3:.3f}"
    assert f"stalls {pictured * 1e3:.3f} ms" in text

    doc = trace_events(s, m.res, 8, 1024)
    slices = [e["dur"] for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "stall"]
    assert sum(slices) == pytest.approx(pictured * 1e6, abs=1e-3 * len(slices))
    assert doc["otherData"]["stall_us"] == pytest.approx(pictured * 1e6, abs=1e-3)
    assert doc["otherData"]["expected_stall_us"] == pytest.approx(expected * 1e6, abs=1e-3)

    fig = figure(s, m.res, 8, 1024, target.chip(s.chip).hbm_bytes_per_s,
                 rep["hbm_floor_seconds"])
    labels = {t.get_text() for ax in fig.axes for t in ax.get_yticklabels()}
    assert f"compute stalled: {pictured * 1e3:.3f} ms" in labels
    assert f"stalls {expected * 1e3:.3f} ms" in fig.get_suptitle()
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_perf_says_which_routing_it_assumed_and_that_rows_is_an_upper_bound(capsys):
    moe = ROOT / "schedules" / "qwen3_5_35b_a3b.sched"
    args = ["perf", str(moe), "--model", "qwen3_5_moe_mini", "--batch", "4", "--counted"]
    assert main(args + ["--json"]) == 0
    perf = json.loads(capsys.readouterr().out)["perf"]
    assert perf["routing"] == "rows" and "upper bound" in perf["routing_assumption"]
    assert main(args) == 0
    assert "each row picking independently: an upper bound on distinct experts" in \
        capsys.readouterr().out
    assert main(args + ["--routing", "one", "--json"]) == 0
    assert "every row picking alike" in json.loads(capsys.readouterr().out)["perf"][
        "routing_assumption"]

import codecs
import json
import stat

import mkc
import pytest
from conftest import run_python
from mkc.cli import main
from tests_support import ROOT, SPEC


def test_check_prints_budget_tables_for_both_batch_ends_and_every_verify_step():
    r = run_python(["-m", "mkc", "check", str(SPEC)], timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "at batch 1, peak at" in out and "at batch 8, peak at" in out
    # verify 8 sequences 1 to 2: every verify step the VMEM verdict judges, the one no wider
    # than the largest batch too
    assert "in the verify step, 8 rows (1 sequence of 8), peak at" in out
    assert "in the verify step, 16 rows (2 sequences of 8), peak at" in out
    totals = [line for line in out.splitlines() if line.strip().startswith("total")]
    assert len(totals) == 4
    for line in totals:
        used, budget = float(line.split()[1]), float(line.split("of")[1].split()[0])
        assert used <= budget
    assert "ring" in out and "tile padding" in out and "HBM per chip" in out


def test_ir_is_json_with_spans():
    import json
    r = run_python(["-m", "mkc", "ir", str(SPEC), "--model", "qwen3_8_mini"], timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["model"] == "qwen3_8_mini" and doc["ranks"] == 8
    assert doc["stream"]["span"]["line"] > 1


def test_unwritable_output_is_an_error_not_a_traceback(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = run_python(["-m", "mkc", "compile", str(SPEC), "-o", str(blocker / "out")], timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "error[E-IO]" in r.stderr


def test_compile_never_replaces_a_fifo_at_the_modules_path(tmp_path, capsys):
    """The module's path is a FIFO: the atomic write refuses it (a rename would have replaced it
    with a regular file) and says so, leaving no temp file."""
    import os
    out = tmp_path / "qwen3_8_27b__qwen3_8_mini.py"
    os.mkfifo(out)
    assert main(["compile", str(SPEC), "--model", "qwen3_8_mini", "-o", str(tmp_path)]) == 1
    assert "is not a regular file mkc may write" in capsys.readouterr().err
    assert stat.S_ISFIFO(out.stat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


@pytest.mark.parametrize("command", [["retarget", "--target", "v6e topology 2x4", "--models", "1"],
                                     ["tune", "--budget", "1"]])
@pytest.mark.parametrize("out,says", [("spec.sched/../spec.sched", "E-IO"),      # through a file
                                      ("missing/../spec.sched", "names the input spec")])
def test_an_output_path_that_leads_back_to_the_input_is_refused(tmp_path, monkeypatch, capsys,
                                                                 command, out, says):
    """-o is the file the write would replace, as the OS resolves it: `spec.sched/..` is no
    directory (os.path.realpath alone would make it one) and `missing/..` is the input's own
    directory. Either is refused before any work, the input as it was."""
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "spec.sched"
    spec.write_bytes(SPEC.read_bytes())
    assert main([command[0], "spec.sched", "--model", "qwen3_8_mini", *command[1:], "-o", out]) == 1
    assert says in capsys.readouterr().err
    assert spec.read_bytes() == SPEC.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.sched"]


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.strip() == f"mkc {mkc.__version__}"


def test_check_json_reports_verdict_and_budget(capsys):
    assert main(["check", str(SPEC), "--model", "qwen3_8_mini", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "ok" and doc["diagnostics"] == []
    # the smallest batch and every kernel the VMEM verdict judges, each named
    assert [v["kernel"] for v in doc["budget"]["vmem"]] == [
        "decode step, batch 1", "decode step, batch 8", "verify step, 8 rows (1 sequence of 8)",
        "verify step, 16 rows (2 sequences of 8)"]
    assert [v["batch"] for v in doc["budget"]["vmem"]] == [1, 8, None, None]
    for v in doc["budget"]["vmem"]:
        assert v["peak_bytes"] == sum(b["bytes"] for b in v["buffers"])
        assert v["peak_bytes"] <= doc["budget"]["vmem_budget_bytes"]
        scratch = [b["bytes"] for b in v["buffers"] if b["class"] == "compiler"]
        assert scratch == [v["compiler_scratch_bytes"]]


def test_json_diagnostics_carry_location_and_hint(capsys):
    broken = ROOT / "tests" / "broken_specs" / "double_wait.sched"
    assert main(["compile", str(broken), "--json", "-o", "/nonexistent"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "error" and "budget" not in doc
    (d,) = doc["diagnostics"]
    assert d["code"] == "E-DMA-WAIT" and d["file"] == str(broken)
    assert d["line"] == 30 and d["column"] == 5 and d["hint"]


def test_generated_file_has_the_usual_mode(tmp_path):
    assert main(["compile", str(SPEC), "--model", "qwen3_8_mini", "-o", str(tmp_path)]) == 0
    (out,) = tmp_path.glob("*.py")
    assert stat.S_IMODE(out.stat().st_mode) & 0o044 == 0o044     # group and others can read


def test_non_utf8_spec_is_a_diagnostic(tmp_path, capsys):
    spec = tmp_path / "bad.sched"
    spec.write_bytes(SPEC.read_bytes().replace(b"tp = 8", b"tp = \xff8"))
    assert main(["check", str(spec)]) == 1
    err = capsys.readouterr().err
    line = next(i for i, t in enumerate(SPEC.read_text().splitlines(), 1) if "tp = 8" in t)
    assert f"bad.sched:{line}:" in err and "E-ENCODING" in err and "0xff" in err


def test_spec_that_is_a_directory_or_device_is_a_diagnostic(capsys):
    for path in (str(ROOT), "/dev/zero"):
        assert main(["check", path]) == 1
        assert "E-IO" in capsys.readouterr().err


@pytest.mark.slow
def test_check_confirm_reports_libtpus_verdict_beside_mkcs():
    r = run_python(["-m", "mkc", "check", str(SPEC), "--model", "qwen3_8_mini", "--confirm",
                    "--json"], timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    confirm = json.loads(r.stdout)["confirm"]
    assert confirm["agree"]
    # every kernel the verdict judges: the decode step at 8 and the verify steps of 8 and 16 rows
    assert [k["kernel"] for k in confirm["kernels"]] == [
        "decode step, batch 8", "verify step, 8 rows (1 sequence of 8)",
        "verify step, 16 rows (2 sequences of 8)"]
    for k in confirm["kernels"]:
        assert k["libtpu"] == "fits" and k["mkc_fits"] and k["agree"]
        assert 0 < k["used_bytes"] <= k["limit_bytes"]


@pytest.mark.parametrize("cmd", [["perf"], ["tune", "-o", "/nonexistent/tuned.sched"]])
def test_perf_and_tune_on_a_generation_without_step_time_constants(cmd, capsys, tmp_path,
                                                                    monkeypatch):
    """The step-time model's constants are data per generation: without its file a spec still
    checks, but `mkc perf` and `mkc tune` say what is missing instead of a KeyError."""
    from mkc.perf import constants
    monkeypatch.setattr(constants, "DATA", tmp_path)
    spec = ROOT / "schedules" / "qwen3_8_27b_v6e.sched"
    assert main([cmd[0], str(spec), *cmd[1:]]) == 1
    err = capsys.readouterr().err
    assert "error[E-PERF]: the step-time model has no constants for v6e" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, says", [
    (["examples/run_mini.py", "--spec", "nope.sched"], "--spec nope.sched: no such file"),
    (["examples/run_mini.py", "--model", "typo"], "--model typo: not a shipped config; choose one of"),
    (["examples/run_k3_mini.py", "--spec", "nope.sched"], "--spec nope.sched: no such file"),
    (["examples/speculative.py", "--model", "typo"], "qwen3_8_mini"),
    (["examples/run_mini.py", "--batch", "0"], "argument --batch: expected an integer of at least 1"),
    (["examples/run_mini.py", "--batch", "99"], "--batch 99: the spec builds its kernel for batches 1 to 8"),
    (["examples/run_mini.py", "--steps", "0"], "argument --steps: expected an integer of at least 1"),
    (["examples/run_mini.py", "--mutate", "typo.op"], "unknown mutants typo.op: choose from"),
    (["examples/run_k3_mini.py", "--mutants", "moe.expert,typo"], "unknown mutants typo: choose from"),
    (["examples/speculative.py", "--prompt", "1,x"], "--prompt '1,x': expected comma-separated token ids"),
    (["examples/speculative.py", "--rows", "99"], "--rows 99: the spec's verify step takes at most 8"),
])
def test_the_runners_refuse_bad_arguments_with_a_usage_error(args, says):
    r = run_python(args, timeout=300)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_two_specs_with_one_schedule_name_do_not_overwrite_each_other(tmp_path, capsys):
    """A spec copied to retarget it keeps its `schedule` name: compiling both into one
    directory is refused at the second's schedule line, not a silent overwrite; recompiling
    the first replaces its own module."""
    text = SPEC.read_text()
    (tmp_path / "a.sched").write_text(text)
    (tmp_path / "b.sched").write_text(text.replace("verify  8 sequences 1 to 2", "verify  4"))
    out = tmp_path / "out"
    assert main(["compile", str(tmp_path / "a.sched"), "--model", "qwen3_8_mini", "-o", str(out)]) == 0
    module = next(out.iterdir())
    first = module.read_text()
    assert main(["compile", str(tmp_path / "b.sched"), "--model", "qwen3_8_mini", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.startswith("schedule "))
    assert f"b.sched:{line}:1: error[E-OUTPUT]" in err and "generated from a.sched" in err
    assert module.read_text() == first
    assert main(["compile", str(tmp_path / "a.sched"), "--model", "qwen3_8_mini", "-o", str(out)]) == 0


# Each numeric option's values that mean nothing: usage errors naming the option, before any
# work (0 or a negative count, a non-finite or negative number, a number too long to convert).
MEANINGLESS = [("perf", "--batch", "0"), ("perf", "--batch", "-1"), ("perf", "--context", "-1"),
               ("perf", "--verify", "0"), ("perf", "--acceptance", "inf"),
               ("perf", "--batch", "9" * 5000), ("tune", "--budget", "-3"),
               ("tune", "--min-headroom", "inf"), ("tune", "--min-headroom", "nan"),
               ("tune", "--min-headroom", "-1"), ("retarget", "--models", "0")]


@pytest.mark.parametrize("command, option, value", MEANINGLESS)
def test_a_meaningless_number_is_a_usage_error(tmp_path, capsys, command, option, value):
    extra = {"tune": ["-o", str(tmp_path / "t.sched")],
             "retarget": ["-o", str(tmp_path / "r.sched"), "--target", "v6e topology 2x4"]}
    with pytest.raises(SystemExit) as e:
        main([command, str(SPEC), *extra.get(command, []), option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: expected a" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_confirm_refuses_a_meaningless_batch_or_timeout(capsys):
    from mkc.confirm import main as confirm_main
    for args in (["--batch", "0"], ["--timeout", "nan"], ["--timeout", "-5"]):
        with pytest.raises(SystemExit) as e:
            confirm_main([str(SPEC), *args])
        assert e.value.code == 2 and f"argument {args[0]}: expected a" in capsys.readouterr().err


def test_a_reader_closing_the_pipe_ends_it_quietly():
    """`mkc fmt - < spec | true`: the reader is gone before mkc writes; mkc stops as a pipe's
    writer does (exit 128 + SIGPIPE), with no traceback."""
    import subprocess
    import sys
    r = subprocess.run(f"{sys.executable} -m mkc fmt - < {SPEC} | true; echo rc=${{PIPESTATUS[0]}} >&2",
                       shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and "rc=141" in r.stderr, r.stderr


def test_a_leading_byte_order_mark_is_not_part_of_the_spec(tmp_path, capsys):
    spec = tmp_path / "bom.sched"
    spec.write_bytes(codecs.BOM_UTF8 + SPEC.read_bytes())
    assert main(["check", str(spec)]) == 0
    spec.write_bytes(codecs.BOM_UTF8 + SPEC.read_bytes().replace(b"tp = 8", b"tp = \xff8"))
    assert main(["check", str(spec)]) == 1
    line = next(i for i, t in enumerate(SPEC.read_text().splitlines(), 1) if "tp = 8" in t)
    assert f"bom.sched:{line}:" in capsys.readouterr().err


def test_an_unwritable_output_is_named_as_given_not_by_its_temp_file(capsys):
    assert main(["perf", str(SPEC), "--plot", "/proc/mkc_picture.png"]) == 1
    err = capsys.readouterr().err
    assert "/proc/mkc_picture.png:1:1: error[E-IO]" in err and ".tmp" not in err

from conftest import run_python
from tests_support import SPEC


def test_check_prints_budget_tables_for_both_batch_ends():
    r = run_python(["-m", "mkc", "check", str(SPEC)], timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "at batch 1, peak at" in out and "at batch 8, peak at" in out
    totals = [line for line in out.splitlines() if line.strip().startswith("total")]
    assert len(totals) == 2
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
    assert r.returncode == 1 and "Traceback" not in r.stderr and "mkc: error:" in r.stderr

"""benchmarks/tpu_bench.py: its timing and summary, its trace reading, and its whole path run on
CPU (a MINI module in interpret mode), which must say it is not a TPU timing."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tpu_bench  # noqa: E402


def test_steps_are_timed_one_by_one_after_the_warmup():
    calls = []

    def step(x):
        calls.append(x)
        return x + 1
    times = tpu_bench.time_steps(step, lambda out: (0 if out is None else out,), steps=4, warmup=2)
    assert len(times) == 4 and all(t >= 0 for t in times)
    assert calls == [0, 1, 2, 3, 4, 5]                  # each call fed the previous output
    s = tpu_bench.summary([3.0, 1.0, 2.0, 10.0])
    assert s["step_s"] == 2.5 and s["min_s"] == 1.0 and s["max_s"] == 10.0 and s["steps"] == 4
    assert s["iqr_s"] > 0


def test_op_scopes_are_summed_from_a_profiler_trace(tmp_path):
    events = [{"name": "mkc_op:gdn.in_proj", "dur": 1500.0}, {"name": "mkc_op:gdn.in_proj", "dur": 500.0},
              {"name": "mkc_op:tail.lm_head", "dur": 250.0}, {"name": "other", "dur": 9.0},
              {"name": "mkc_op:gqa.attention"}]
    with gzip.open(tmp_path / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert tpu_bench.op_times(str(tmp_path)) == {"gdn.in_proj": pytest.approx(2e-3),
                                                 "tail.lm_head": pytest.approx(2.5e-4)}


def _run(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tpu_bench.py"), *argv],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_a_full_size_model_is_refused_without_a_tpu():
    r = _run(str(ROOT / "schedules" / "qwen3_8_27b.sched"), "--steps", "1")
    assert r.returncode == 2
    assert "no TPU here" in r.stderr and "--model <family>_mini" in r.stderr


@pytest.mark.extended
def test_the_bench_runs_end_to_end_on_cpu_and_says_it_is_not_a_tpu_timing(tmp_path):
    out = tmp_path / "points.json"
    # the decode step only: the verify step's path differs in its inputs alone, and each
    # kernel costs a minute of interpret-mode compile here
    r = _run(str(ROOT / "schedules" / "qwen3_8_27b.sched"), "--model", "qwen3_8_mini",
             "--batch", "1", "--steps", "1", "--warmup", "0", "--out", str(out),
             "--profile", str(tmp_path / "profile"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("NOT a TPU timing") >= 2               # the kernel and the file
    record = json.loads(out.read_text())
    assert record["tpu"] is False and "NOT a TPU timing" in record["note"]
    assert record["chip"].startswith("cpu") and record["libtpu"] and record["jax"]
    assert [(p["kernel"], p["batch"], p["rows"]) for p in record["points"]] == [("decode", 1, 1)]
    assert all(p["step_s"] > 0 and p["min_s"] <= p["step_s"] <= p["max_s"]
               for p in record["points"])
    assert "no mkc_op scopes in the trace" in r.stdout

"""Benchmarks: mkc compile time (full Qwen spec), libtpu compile time of the generated
full-size kernel, interpret-mode time per MINI decode step, and the check time and VMEM peaks
of the full Kimi K3 spec (its kernel is not generated yet). Prints medians and the command
that reproduces each number.

    ./dev bench            (or .venv/bin/python benchmarks/bench.py [--repeats N])
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"
K3_SPEC = ROOT / "schedules" / "kimi_k3.sched"


def _py(args: list[str]) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, check=True)
    return r.stdout


def bench_mkc_compile(repeats: int) -> list[float]:
    from mkc import compiler
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiler.compile_spec(SPEC)
        times.append(time.perf_counter() - t0)
    return times


def bench_k3_check(repeats: int) -> tuple[list[float], dict[int, float]]:
    """Parse, resolve and every check of the full K3 spec (186 sublayers, worst-case experts),
    and its VMEM peaks in MiB at both ends of the batch range."""
    from mkc import compiler
    from mkc.checks import vmem_budget
    from mkc.trace import build_trace
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = compiler.check_spec(K3_SPEC)
        times.append(time.perf_counter() - t0)
    events = build_trace(c.ir)
    peaks = {b: vmem_budget(c.ir, events, b)[0] / 2**20 for b in (c.ir.batch_min, c.ir.batch_max)}
    return times, peaks


def bench_cli_compile(repeats: int) -> list[float]:
    """Wall time of the command a user runs, interpreter start and imports included."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _py(["-m", "mkc", "compile", str(SPEC), "-o", str(ROOT / "generated")])
        times.append(time.perf_counter() - t0)
    return times


def bench_tpu_compile(repeats: int, batch: int) -> list[float]:
    times = []
    for _ in range(repeats):   # a fresh process each time: no compile cache between runs
        out = _py(["benchmarks/tpu_compile.py", "generated/qwen3_8_27b.py", str(batch)])
        times.append(float(out.rsplit(" in ", 1)[1].split()[0]))
    return times


def bench_interpret(steps: int) -> list[float]:
    out = _py(["examples/run_mini.py", "--json", "--steps", str(steps), "--batch", "1"])
    summary = json.loads(next(ln for ln in out.splitlines() if ln.startswith("JSON "))[5:])
    return [s["seconds"] for s in summary["steps"][1:]]     # step 0 includes tracing


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    t = bench_mkc_compile(args.repeats)
    rows.append(("mkc compile, full Qwen 3.8 27B spec, in process (parse to module text)", t,
                 ".venv/bin/python -c 'from mkc import compiler; "
                 "compiler.compile_spec(\"schedules/qwen3_8_27b.sched\")'"))
    t = bench_cli_compile(args.repeats)
    rows.append(("mkc compile, full Qwen 3.8 27B spec, CLI wall time", t,
                 ".venv/bin/mkc compile schedules/qwen3_8_27b.sched"))
    for batch in (1, 8):
        t = bench_tpu_compile(max(1, args.repeats // 2), batch)
        rows.append((f"libtpu compile, full-size kernel, tpu7x=2x2x1, batch {batch}", t,
                     f".venv/bin/python benchmarks/tpu_compile.py generated/qwen3_8_27b.py {batch}"))
    t = bench_interpret(steps=4)
    rows.append(("interpret mode, MINI decode step, 8 CPU devices, on_wait, batch 1", t,
                 ".venv/bin/python examples/run_mini.py --steps 4 --batch 1"))
    t, peaks = bench_k3_check(args.repeats)
    rows.append(("mkc check, full Kimi K3 spec, in process (parse, resolve, trace, checks)", t,
                 ".venv/bin/mkc check schedules/kimi_k3.sched"))
    for name, times, cmd in rows:
        print(f"{name}: median {statistics.median(times):.3f} s over {len(times)} "
              f"(min {min(times):.3f}, max {max(times):.3f})\n    reproduce: {cmd}")
    print("Kimi K3 VMEM peak: " + ", ".join(f"batch {b}: {mib:.2f} MiB" for b, mib in peaks.items())
          + "\n    reproduce: .venv/bin/mkc check schedules/kimi_k3.sched")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kimi K3's all-reduces one-shot against the scattered form (the shipped spec: `scatter from 8
rows` on o_proj in kda and mla, down, and the routed experts (3584 columns, chunks of 448
padded to 512), shared_down's run at once with the same clause), or another clause in its
place, side by side in the step-time model: the step
and its collectives at batch 1, batch 8 and the verify step of 8 rows, each collective's time
by spec line, and the VMEM of the all-reduces' buffers. Modelled, not measured.

    .venv/bin/python benchmarks/scatter_allreduce.py            # cached or shipped measures
    .venv/bin/python benchmarks/scatter_allreduce.py --compiled # compile missing kernels (~1 min each)
    .venv/bin/python benchmarks/scatter_allreduce.py --clause scatter

Each kernel is priced by libtpu's cycles for it where a measure is cached or shipped (with
--compiled, compiled when missing), else counted; the table says which."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mkc.checks import capacity  # noqa: E402
from mkc.compiler import check_spec  # noqa: E402
from mkc.perf.run import model  # noqa: E402
from mkc.trace import build_trace  # noqa: E402
from tests_support import K3_SPEC, k3_scatter_text  # noqa: E402

STEPS = (("B1", 1, None), ("B8", 8, None), ("verify 8", 1, 8))   # (label, batch, verify rows)


def measure(spec: Path, compiled: bool | None) -> dict:
    s = check_spec(spec).ir
    out = {"steps": {}, "vmem": {}}
    for label, batch, verify in STEPS:
        m = model(s, batch, verify_rows=verify, compiled=compiled, keep_timeline=True)
        res = m.res.pictured or m.res
        per_line: dict[tuple[str, int, str], list[float]] = defaultdict(lambda: [0.0, 0])
        for iv in res.timeline:
            if iv.track == "collective":
                key = (iv.kind or "prologue", iv.line, iv.name.split()[0])
                per_line[key][0] += iv.end - iv.start
                per_line[key][1] += 1
        out["steps"][label] = {
            "step_ms": m.res.step_s * 1e3,
            "collectives_ms": m.res.by_cause["collectives"] * 1e3,
            "priced": f"libtpu {m.measure['libtpu']}" if m.measure else "counted",
            "per_line": {k: (v[0] * 1e3, v[1]) for k, v in sorted(per_line.items())}}
    events = build_trace(s)
    for rows in (1, 8):
        peak = capacity.vmem_budget(s, events, rows)[0]
        reduce = {b.name: b.vmem_bytes for b in capacity.kernel_buffers(s, rows)
                  if b.cls == "collective" and not b.name.startswith(("gather__", "exchange__"))}
        out["vmem"][rows] = (peak, reduce)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compiled", action="store_true", help="compile kernels with no cached measure")
    ap.add_argument("--clause", default="scatter from 8 rows", help="the scatter clause to compare")
    args = ap.parse_args()
    compiled = True if args.compiled else None
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, clause in (("one-shot", ""), (args.clause, args.clause)):
            spec = Path(tmp) / name.replace(" ", "_") / K3_SPEC.name
            spec.parent.mkdir()
            spec.write_text(k3_scatter_text(clause))
            results[name] = measure(spec, compiled)
    names = list(results)
    print("Kimi K3 on tpu7x 2x2x4 (modelled, not measured): step and collectives, ms")
    print(f"  {'step':<10}" + "".join(f"{n:>30}" for n in names))
    for label, _, _ in STEPS:
        cells = [results[n]["steps"][label] for n in names]
        print(f"  {label:<10}" + "".join(
            f"{c['step_ms']:>10.3f} (coll. {c['collectives_ms']:.3f})".rjust(30) for c in cells)
            + "   priced by " + ", ".join(c["priced"] for c in cells))
    for label, _, _ in STEPS:
        print(f"  collectives at {label} (kind, spec line: ms over the step, calls):")
        for n in names:
            lines = results[n]["steps"][label]["per_line"]
            print(f"    {n:<22}" + "; ".join(f"{kind}:{line} {what} {ms:.3f} x{calls}"
                                            for (kind, line, what), (ms, calls) in lines.items()))
    for rows in (1, 8):
        print(f"  VMEM at {rows} rows: " + "; ".join(
            f"{n}: peak {results[n]['vmem'][rows][0] / 2**20:.2f} MiB, all-reduce buffers "
            f"{sum(results[n]['vmem'][rows][1].values()) / 2**20:.2f} MiB "
            f"({', '.join(results[n]['vmem'][rows][1])})" for n in names))


if __name__ == "__main__":
    main()

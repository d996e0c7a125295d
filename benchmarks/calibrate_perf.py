"""Fit the step-time model's one free constant to published step times and record the fit.

    .venv/bin/python benchmarks/calibrate_perf.py            # fit, print, write the data file
    .venv/bin/python benchmarks/calibrate_perf.py --dry-run  # fit and print only

The model prices compute by the cycles libtpu scheduled for the emitted kernel
(`mkc.perf.bundles`) at the clock JAX's chip table implies. What no compile or table gives is
the level of the fixed latencies (DMA issue, ICI hop, a collective round's semaphore exchange,
an op's fixed cost), each stated at a few tenths of a microsecond with no published figure:
their common scale, `latency_scale`, is the one fitted constant, within the bounds the inputs
give (at most 2x either side of the stated values).

Inputs: `mkc/perf/data/calibration_points.json` (the published points, the spec they belong
to, the bounds, the speculative hold-out). Output: `latency_scale` (source "fitted ...") and a
`calibration` record (points, residuals, each point predicted from the others, the
speculative hold-out, and the fit at each DMA queue count of the sweep) in
`mkc/perf/data/<chip>.json`. The calibration spec's kernels are compiled once (cached; the
shipped measures in mkc/perf/data/bundles/ spare it). When a real TPU measurement arrives
(`benchmarks/tpu_bench.py` writes points in this file's format), add it as a point and rerun.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mkc.compiler import check_spec  # noqa: E402
from mkc.perf import constants  # noqa: E402
from mkc.perf.run import compiled_measure, step_model  # noqa: E402

POINTS = constants.DATA / "calibration_points.json"
COMMAND = ".venv/bin/python benchmarks/calibrate_perf.py"


class Steps:
    """The modelled step at calibration points for a value of the fitted constant: traces and
    compiled measures built once (neither depends on the constants)."""

    def __init__(self, cfg: dict, c_ir, fixed: dict | None = None) -> None:
        self.cfg, self.ir, self.fixed = cfg, c_ir, fixed or {}
        self.name = cfg["fit"][0]
        self.tokens = cfg.get("tokens_in_cache") or c_ir.context
        self.traces: dict = {}
        self.measures: dict = {}

    def __call__(self, points: list[dict], value: float) -> list[float]:
        """Each point's step (a point with `sequences` is a verify step)."""
        rates = constants.rates(self.cfg["chip"], self.fixed | {self.name: value})
        out = []
        for p in points:
            seqs = p.get("sequences")
            key = (p["batch"], seqs)
            if key not in self.measures:
                self.measures[key] = compiled_measure(self.ir, p["batch"], seqs,
                                                      compile_missing=True)
            out.append(step_model(self.ir, p["batch"], self.tokens, rates, keep_timeline=False,
                                  traces=self.traces, sequences=seqs,
                                  compiled=self.measures[key]).step_s)
        return out

    def fit(self, points: list[dict]) -> tuple[float, list[float]]:
        """The value minimising the squared log errors at `points` inside the bounds (each
        step grows with it): golden-section search on its log."""
        def loss(u: float) -> float:
            return sum(math.log(g / p["step_s"]) ** 2
                       for g, p in zip(self(points, math.exp(u)), points))

        a, b = (math.log(x) for x in self.cfg["bounds"][self.name])
        g = (math.sqrt(5) - 1) / 2
        c, d = b - g * (b - a), a + g * (b - a)
        fc, fd = loss(c), loss(d)
        for _ in range(28):
            if fc < fd:
                b, d, fd = d, c, fc
                c = b - g * (b - a)
                fc = loss(c)
            else:
                a, c, fc = c, d, fd
                d = a + g * (b - a)
                fd = loss(d)
        value = math.exp((a + b) / 2)
        return value, self(points, value)

    def at_bound(self, value: float) -> bool:
        return min(abs(math.log(value / b)) for b in self.cfg["bounds"][self.name]) < 1e-3


def _error(got: float, published: float) -> float:
    return round(100 * (got / published - 1), 3)


def _point(p: dict, got: float) -> dict:
    return {"batch": p["batch"], "published_step_s": p["step_s"],
            "published_tokens_per_s": p["tokens_per_s"], "modelled_step_s": float(f"{got:.6g}"),
            "error_percent": _error(got, p["step_s"])}


def calibrate(cfg: dict, c_ir, dry_run: bool) -> int:
    """Fit, test on what was not fitted (each point from the others, the speculative step),
    sweep the DMA queue count, and record."""
    steps = Steps(cfg, c_ir)
    name, bounds, chip = steps.name, cfg["bounds"][steps.name], cfg["chip"]
    clock = constants.rates(chip).clock_hz
    value, got = steps.fit(cfg["points"])
    points = [_point(p, g) for p, g in zip(cfg["points"], got)]
    print(f"{name} {value:.4g} (bounds {bounds[0]:g}-{bounds[1]:g}"
          f"{', at its bound' if steps.at_bound(value) else ''}); compute at the {clock / 1e9:.3f} "
          "GHz clock JAX's table implies")
    for p in points:
        print(f"  batch {p['batch']}: published {p['published_step_s'] * 1e3:.3f} ms, modelled "
              f"{p['modelled_step_s'] * 1e3:.3f} ms ({p['error_percent']:+.2f}%)")
    leave_one_out = []
    for n, p in enumerate(cfg["points"]):
        rest = cfg["points"][:n] + cfg["points"][n + 1:]
        if not rest:
            continue
        v_rest, _ = steps.fit(rest)
        (g,) = steps([p], v_rest)
        leave_one_out.append({"batch": p["batch"], "fitted_on": [q["batch"] for q in rest],
                              name: float(f"{v_rest:.6g}"), "published_step_s": p["step_s"],
                              "modelled_step_s": float(f"{g:.6g}"),
                              "error_percent": _error(g, p["step_s"])})
        print(f"  hold-out: batch {p['batch']} predicted with {name} fitted on the others "
              f"({v_rest:.4g}): {g * 1e3:.3f} ms ({leave_one_out[-1]['error_percent']:+.1f}%)")
    speculative = None
    if h := cfg.get("speculative_holdout"):
        (g,) = steps([{"batch": h["rows"] * h["sequences"], "sequences": h["sequences"]}], value)
        speculative = {"rows": h["rows"], "sequences": h["sequences"],
                       "published_step_s": h["step_s"], "modelled_step_s": float(f"{g:.6g}"),
                       "error_percent": _error(g, h["step_s"])}
        print(f"  hold-out, never fitted: the speculative step of {h['rows']} rows: published "
              f"~{h['step_s'] * 1e3:.2f} ms, modelled {g * 1e3:.2f} ms "
              f"({speculative['error_percent']:+.1f}%)")
    sweep = []
    for q in cfg.get("dma_queues_sweep", []):
        at_q = Steps(cfg, c_ir, {"dma_queues": q})
        at_q.traces, at_q.measures = steps.traces, steps.measures
        v_q, got_q = at_q.fit(cfg["points"])
        sweep.append({"dma_queues": q, name: float(f"{v_q:.6g}"), "at_bound": at_q.at_bound(v_q),
                      "error_percent": [_error(g, p["step_s"])
                                        for p, g in zip(cfg["points"], got_q)]})
        print(f"  dma_queues {q}: {name} {v_q:.4g}, errors "
              + ", ".join(f"B{p['batch']} {e:+.2f}%"
                          for p, e in zip(cfg["points"], sweep[-1]["error_percent"])))
    if dry_run:
        return 0
    path = constants.data_path(chip)
    data = json.loads(path.read_text())
    data["constants"][name] = {"value": float(f"{value:.6g}"), "source": (
        f"fitted by benchmarks/calibrate_perf.py to {len(points)} published step times ("
        + ", ".join(f"B{p['batch']}" for p in points) + "; mkc/perf/data/calibration_points."
        f"json) under the compiled price, within {bounds[0]:g}-{bounds[1]:g}x of the stated "
        "latencies: the model's one fitted constant")}
    data["calibration"] = {
        "reference": cfg["reference"], "spec": cfg["spec"], "tokens_in_cache": steps.tokens,
        "fitted": [name], "values": {name: float(f"{value:.6g}")}, "bounds": bounds,
        "at_bound": steps.at_bound(value), "clock_hz": clock,
        "clock_source": "jax: bf16_ops_per_second / (2 x num_mxus x mxu_column^2)",
        "libtpu": next(iter(steps.measures.values()))["libtpu"] if steps.measures else "",
        "routing": "expected over uniform routing: the slowest expert group of the reduce "
                   "peers (mkc/perf/routing.py), steps at the two whole expert counts around "
                   "it weighted",
        "method": f"golden-section search on log {name}, least squares of log step time over "
                  "the points; one constant for two points, so the errors are residuals",
        "points": points, "leave_one_out": leave_one_out, "speculative_holdout": speculative,
        "dma_queues_sweep": sweep, "command": COMMAND}
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=str(POINTS), help="calibration inputs (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    args = ap.parse_args()
    cfg = json.loads(Path(args.points).read_text())
    c_ir = check_spec(ROOT / cfg["spec"], cfg.get("model")).ir
    return calibrate(cfg, c_ir, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())

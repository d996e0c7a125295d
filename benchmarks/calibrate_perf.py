"""Fit the step-time model's free constants to published step times and record the fit.

    .venv/bin/python benchmarks/calibrate_perf.py            # fit, print, write the data file
    .venv/bin/python benchmarks/calibrate_perf.py --dry-run  # fit and print only

Inputs: `mkc/perf/data/calibration_points.json` (the published points, the spec they belong
to, which constants to fit, start values and bounds). Output: the fitted values (source
"fitted: ...") and a `calibration` record (points, modelled times, errors) in
`mkc/perf/data/<chip>.json`. Every other constant keeps its recorded value and source. When a
real TPU measurement arrives, add it as a point (or replace the published ones) and rerun.

With as many points as fitted constants the fit is a root find (Newton's method on the log of
the constants, bounded); with more points it minimises the squared relative errors.
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
from mkc.perf.run import step_model  # noqa: E402

POINTS = constants.DATA / "calibration_points.json"


def modelled(ir, tokens, rates, points, traces) -> list[float]:
    """The modelled step at each point: the expectation over routing (`step_model`), traces
    cached across calls."""
    return [step_model(ir, p["batch"], tokens, rates, keep_timeline=False, traces=traces).step_s
            for p in points]


def fit(cfg: dict, verbose: bool = True, names: list[str] | None = None,
        points: list[dict] | None = None, fixed: dict | None = None, ir=None,
        traces: dict | None = None) -> tuple[dict, list[float]]:
    """Fit `names` (default: the config's) to `points` (default: all), other constants at
    their recorded values overridden by `fixed`; returns the values and the modelled steps."""
    c_ir = ir or check_spec(ROOT / cfg["spec"], cfg.get("model")).ir
    tokens = cfg.get("tokens_in_cache") or c_ir.context
    points = points or cfg["points"]
    traces = {} if traces is None else traces
    names = names or cfg["fit"]
    lo = [cfg["bounds"][n][0] for n in names]
    hi = [cfg["bounds"][n][1] for n in names]
    base = constants.rates(cfg["chip"], fixed)
    # Work in a transformed variable so a bound of 0 stays reachable: u = log(x + eps).
    eps = [max(1e-12, 1e-3 * (h - lo_)) for lo_, h in zip(lo, hi)]
    x = [cfg["start"][n] for n in names]

    def residuals(vals: list[float]) -> list[float]:
        r = base.replace(**dict(zip(names, vals)))
        got = modelled(c_ir, tokens, r, points, traces)
        return [math.log(g / p["step_s"]) for g, p in zip(got, points)]

    def clamp(vals):
        return [min(max(v, a), b) for v, a, b in zip(vals, lo, hi)]

    res = residuals(x)
    for it in range(30):
        if verbose:
            print(f"  iter {it}: " + ", ".join(f"{n}={v:.4g}" for n, v in zip(names, x))
                  + "  errors " + ", ".join(f"{100 * (math.exp(e) - 1):+.2f}%" for e in res))
        if max(abs(e) for e in res) < 1e-4:
            break
        u = [math.log(v + e) for v, e in zip(x, eps)]
        jac = []
        for j in range(len(names)):
            du = 0.05
            u2 = list(u)
            u2[j] += du
            x2 = clamp([math.exp(a) - e for a, e in zip(u2, eps)])
            r2 = residuals(x2)
            jac.append([(a - b) / du for a, b in zip(r2, res)])      # column j
        step = _solve(jac, res)
        for damp in (1.0, 0.5, 0.25, 0.125, 0.0625):
            u_new = [a - damp * s for a, s in zip(u, step)]
            x_new = clamp([math.exp(a) - e for a, e in zip(u_new, eps)])
            r_new = residuals(x_new)
            if sum(e * e for e in r_new) < sum(e * e for e in res):
                x, res = x_new, r_new
                break
        else:
            break
    got = modelled(c_ir, tokens, base.replace(**dict(zip(names, x))), points, traces)
    return dict(zip(names, x)), got


def holdout(cfg: dict, fixed: dict | None = None, ir=None, traces=None,
            verbose: bool = False) -> dict:
    """Fit the hold-out's constants on its `on` batches (the others at their assumed values,
    `holdout.fixed`), predict the `predict` batches: a test of prediction, unlike the exact
    fit."""
    h = cfg["holdout"]
    fixed = (fixed or {}) | h.get("fixed", {})
    on = [p for p in cfg["points"] if p["batch"] in h["on"]]
    out = [p for p in cfg["points"] if p["batch"] in h["predict"]]
    values, _ = fit(cfg, verbose, names=h["fit"], points=on, fixed=fixed, ir=ir, traces=traces)
    c_ir = ir or check_spec(ROOT / cfg["spec"], cfg.get("model")).ir
    tokens = cfg.get("tokens_in_cache") or c_ir.context
    r = constants.rates(cfg["chip"], fixed).replace(**values)
    got = modelled(c_ir, tokens, r, on + out, traces if traces is not None else {})
    return {"fit": h["fit"], "fixed": h.get("fixed", {}), "on": h["on"],
            "values": {n: float(f"{v:.6g}") for n, v in values.items()},
            "points": [{"batch": p["batch"], "role": "fitted" if p in on else "predicted",
                        "published_step_s": p["step_s"], "modelled_step_s": float(f"{g:.6g}"),
                        "error_percent": round(100 * (g / p["step_s"] - 1), 3)}
                       for p, g in zip(on + out, got)]}


def _solve(jac_cols: list[list[float]], res: list[float]) -> list[float]:
    """Least-squares step J s = res (J given by columns), by the normal equations."""
    n = len(jac_cols)
    a = [[sum(ci * cj for ci, cj in zip(jac_cols[i], jac_cols[j])) + (1e-9 if i == j else 0)
          for j in range(n)] for i in range(n)]
    b = [sum(ci * r for ci, r in zip(jac_cols[i], res)) for i in range(n)]
    for i in range(n):                       # Gauss-Jordan, n is tiny
        p = max(range(i, n), key=lambda k: abs(a[k][i]))
        a[i], a[p], b[i], b[p] = a[p], a[i], b[p], b[i]
        for k in range(n):
            if k != i and a[i][i]:
                f = a[k][i] / a[i][i]
                a[k] = [x - f * y for x, y in zip(a[k], a[i])]
                b[k] -= f * b[i]
    return [b[i] / a[i][i] if a[i][i] else 0.0 for i in range(n)]


def _row(p: dict, g: float) -> dict:
    return {"batch": p["batch"], "published_step_s": p["step_s"],
            "published_tokens_per_s": p["tokens_per_s"], "modelled_step_s": g,
            "error_percent": 100 * (g / p["step_s"] - 1)}


def speculative_holdout(cfg: dict, c_ir, rates) -> dict | None:
    """The published speculative step (never fitted) against the model's verify step of the
    same rows, at `rates`: {rows, sequences, published_step_s, modelled_step_s, error_percent}."""
    h = cfg.get("speculative_holdout")
    if not h:
        return None
    rows, seqs = h["rows"], h["sequences"]
    got = step_model(c_ir, rows * seqs, cfg.get("tokens_in_cache") or c_ir.context, rates,
                     keep_timeline=False, sequences=seqs).step_s
    return {"rows": rows, "sequences": seqs, "published_step_s": h["step_s"],
            "modelled_step_s": float(f"{got:.6g}"),
            "error_percent": round(100 * (got / h["step_s"] - 1), 3)}


def record_blocked(cfg: dict, reason: str, c_ir, traces: dict, dry_run: bool) -> int:
    """No fit while the calibration spec cannot describe the reference kernel (`blocked` in the
    inputs says why): record what the current model gives at the points with the constants as
    they are, so the figures the model prints stay honest about it."""
    got = modelled(c_ir, cfg.get("tokens_in_cache") or c_ir.context,
                   constants.rates(cfg["chip"]), cfg["points"], traces)
    points = [_row(p, g) for p, g in zip(cfg["points"], got)]
    print(f"not fitting: {reason}")
    for p in points:
        print(f"  batch {p['batch']}: published {p['published_step_s'] * 1e3:.3f} ms, modelled "
              f"now {p['modelled_step_s'] * 1e3:.3f} ms ({p['error_percent']:+.1f}%)")
    spec = speculative_holdout(cfg, c_ir, constants.rates(cfg["chip"]))
    if spec:
        print(f"  hold-out, speculative step of {spec['rows']} rows: published "
              f"{spec['published_step_s'] * 1e3:.2f} ms, modelled now "
              f"{spec['modelled_step_s'] * 1e3:.2f} ms ({spec['error_percent']:+.1f}%)")
    if dry_run:
        return 0
    path = constants.data_path(cfg["chip"])
    data = json.loads(path.read_text())
    data["calibration"]["blocked"] = {
        "reason": reason,
        "points": [p | {"modelled_step_s": float(f"{p['modelled_step_s']:.6g}"),
                        "error_percent": round(p["error_percent"], 3)} for p in points],
        "speculative_holdout": spec,
        "command": ".venv/bin/python benchmarks/calibrate_perf.py"}
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


# The compiled price's one fitted constant, and how far from its stated value it may go: the
# level of the fixed latencies (DMA issue, ICI hop, a collective round's semaphore exchange),
# each stated at 0.5 us with no published figure; compute comes from libtpu's cycles at the
# clock JAX's table implies.
FITTED, BOUNDS = "latency_scale", (0.5, 2.0)


def compiled_steps(c_ir, tokens: int, points: list[dict], scale: float, chip: str,
                   traces: dict, measures: dict) -> list[float]:
    """The compiled price's step at each point (a point with `sequences` is a verify step),
    with the fitted constant at `scale`."""
    from mkc.perf.run import compiled_measure
    rates = constants.compiled_rates(chip, {FITTED: scale})
    out = []
    for p in points:
        seqs = p.get("sequences")
        key = (p["batch"], seqs)
        if key not in measures:
            measures[key] = compiled_measure(c_ir, p["batch"], seqs, compile_missing=True)
        out.append(step_model(c_ir, p["batch"], tokens, rates, keep_timeline=False,
                              traces=traces, sequences=seqs, compiled=measures[key]).step_s)
    return out


def fit_one(c_ir, tokens: int, points: list[dict], chip: str, traces: dict,
            measures: dict) -> tuple[float, list[float]]:
    """The fitted constant minimising the squared log errors at `points`, inside BOUNDS (each
    step grows with it): golden-section search on its log."""
    def loss(u: float) -> float:
        got = compiled_steps(c_ir, tokens, points, math.exp(u), chip, traces, measures)
        return sum(math.log(g / p["step_s"]) ** 2 for g, p in zip(got, points))

    a, b = (math.log(x) for x in BOUNDS)
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
    scale = math.exp((a + b) / 2)
    return scale, compiled_steps(c_ir, tokens, points, scale, chip, traces, measures)


def calibrate_compiled(cfg: dict, c_ir, dry_run: bool) -> int:
    """Fit the compiled price's one constant to the published points and test it on what it
    was not fitted to: each point predicted from the others, and the speculative step. Needs
    the calibration spec's kernels compiled (`mkc perf SPEC --bundles`, cached)."""
    chip, tokens = cfg["chip"], cfg.get("tokens_in_cache") or c_ir.context
    traces: dict = {}
    measures: dict = {}
    clock = constants.rates(chip).clock_hz
    scale, got = fit_one(c_ir, tokens, cfg["points"], chip, traces, measures)
    points = [_row(p, g) for p, g in zip(cfg["points"], got)]
    at_bound = min(abs(math.log(scale / b)) for b in BOUNDS) < 1e-3
    print(f"compiled price: {FITTED} {scale:.4g} (bounds {BOUNDS[0]:g}-{BOUNDS[1]:g}"
          f"{', at its bound' if at_bound else ''}); clock {clock / 1e9:.3f} GHz from JAX's table")
    for p in points:
        print(f"  batch {p['batch']}: published {p['published_step_s'] * 1e3:.3f} ms, modelled "
              f"{p['modelled_step_s'] * 1e3:.3f} ms ({p['error_percent']:+.2f}%)")
    leave_one_out = []
    for n, p in enumerate(cfg["points"]):
        rest = cfg["points"][:n] + cfg["points"][n + 1:]
        if not rest:
            continue
        s_rest, _ = fit_one(c_ir, tokens, rest, chip, traces, measures)
        (g,) = compiled_steps(c_ir, tokens, [p], s_rest, chip, traces, measures)
        leave_one_out.append({"batch": p["batch"], "fitted_on": [q["batch"] for q in rest],
                              FITTED: float(f"{s_rest:.6g}"),
                              "published_step_s": p["step_s"],
                              "modelled_step_s": float(f"{g:.6g}"),
                              "error_percent": round(100 * (g / p["step_s"] - 1), 3)})
        print(f"  hold-out: batch {p['batch']} predicted from {FITTED} fitted on the others "
              f"({s_rest:.4g}): {g * 1e3:.3f} ms ({leave_one_out[-1]['error_percent']:+.1f}%)")
    spec = None
    if h := cfg.get("speculative_holdout"):
        (g,) = compiled_steps(c_ir, tokens, [{"batch": h["rows"] * h["sequences"],
                                              "sequences": h["sequences"]}],
                              scale, chip, traces, measures)
        spec = {"rows": h["rows"], "sequences": h["sequences"], "published_step_s": h["step_s"],
                "modelled_step_s": float(f"{g:.6g}"),
                "error_percent": round(100 * (g / h["step_s"] - 1), 3)}
        print(f"  hold-out, never fitted: the speculative step of {h['rows']} rows: published "
              f"~{h['step_s'] * 1e3:.2f} ms, modelled {g * 1e3:.2f} ms "
              f"({spec['error_percent']:+.1f}%)")
    if dry_run:
        return 0
    path = constants.data_path(chip)
    data = json.loads(path.read_text())
    data["compiled_calibration"] = {
        "reference": cfg["reference"], "spec": cfg["spec"], "tokens_in_cache": tokens,
        "fitted": [FITTED], "values": {FITTED: float(f"{scale:.6g}")}, "bounds": list(BOUNDS),
        "at_bound": at_bound, "clock_hz": clock,
        "clock_source": "jax: bf16_ops_per_second / (2 x num_mxus x mxu_column^2)",
        "libtpu": next(iter(measures.values()))["libtpu"] if measures else "",
        "method": f"golden-section search on log {FITTED}, least squares of log step time "
                  "over the points; one constant for two points, so the errors are residuals",
        "points": [p | {"modelled_step_s": float(f"{p['modelled_step_s']:.6g}"),
                        "error_percent": round(p["error_percent"], 3)} for p in points],
        "leave_one_out": leave_one_out, "speculative_holdout": spec,
        "command": ".venv/bin/python benchmarks/calibrate_perf.py --compiled"}
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=str(POINTS), help="calibration inputs (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    ap.add_argument("--compiled", action="store_true",
                    help="fit the compiled price's clock (mkc.perf.bundles) instead")
    args = ap.parse_args()
    cfg = json.loads(Path(args.points).read_text())
    c_ir = check_spec(ROOT / cfg["spec"], cfg.get("model")).ir
    if args.compiled:
        return calibrate_compiled(cfg, c_ir, args.dry_run)
    traces: dict = {}                 # the traces do not depend on the constants
    if blocked := cfg.get("blocked"):
        return record_blocked(cfg, blocked, c_ir, traces, args.dry_run)
    queues = constants.rates(cfg["chip"]).dma_queues
    sweep = []
    for q in cfg.get("dma_queues_sweep", []):
        fixed = {"dma_queues": q}
        print(f"dma_queues = {q}: fit {', '.join(cfg['fit'])} to every point, then the "
              f"hold-out (fit {', '.join(cfg['holdout']['fit'])} on B"
              f"{', B'.join(map(str, cfg['holdout']['on']))})")
        values, got = fit(cfg, False, fixed=fixed, ir=c_ir, traces=traces)
        ho = holdout(cfg, fixed, ir=c_ir, traces=traces)
        row = {"dma_queues": q,
               "fit": {n: float(f"{v:.6g}") for n, v in values.items()},
               "fit_error_percent": [round(100 * (g / p["step_s"] - 1), 3)
                                     for p, g in zip(cfg["points"], got)],
               "holdout": ho}
        sweep.append(row)
        print("  fit " + ", ".join(f"{n}={v:.4g}" for n, v in values.items()) + "; errors "
              + ", ".join(f"B{p['batch']} {e:+.2f}%" for p, e in
                          zip(cfg["points"], row["fit_error_percent"])))
        print("  hold-out " + ", ".join(f"{n}={v:.4g}" for n, v in ho["values"].items())
              + "; " + ", ".join(f"B{p['batch']} ({p['role']}) {p['error_percent']:+.2f}%"
                                 for p in ho["points"]))
    print(f"fitting {', '.join(cfg['fit'])} to {len(cfg['points'])} points of {cfg['reference']} "
          f"(dma_queues = {queues:g}, the data file's)")
    values, got = fit(cfg, ir=c_ir, traces=traces)
    ho = holdout(cfg, ir=c_ir, traces=traces)
    points = [_row(p, g) for p, g in zip(cfg["points"], got)]
    for p in points:
        print(f"  batch {p['batch']}: published {p['published_step_s'] * 1e3:.3f} ms, modelled "
              f"{p['modelled_step_s'] * 1e3:.3f} ms ({p['error_percent']:+.2f}%)")
    for n, v in values.items():
        print(f"  {n} = {v:.6g}")
    for p in ho["points"]:
        print(f"  hold-out ({', '.join(ho['fit'])} fitted on B{', B'.join(map(str, ho['on']))}, "
              f"{', '.join(f'{k} = {v:g}' for k, v in ho['fixed'].items())}): batch {p['batch']} "
              f"{p['role']}: modelled {p['modelled_step_s'] * 1e3:.3f} ms "
              f"({p['error_percent']:+.2f}%)")
    spec = speculative_holdout(cfg, c_ir, constants.rates(cfg["chip"], values))
    if spec:
        print(f"  hold-out, never fitted: the speculative step of {spec['rows']} rows: published "
              f"~{spec['published_step_s'] * 1e3:.2f} ms, modelled {spec['modelled_step_s'] * 1e3:.2f} "
              f"ms ({spec['error_percent']:+.1f}%)")
    if args.dry_run:
        return 0
    path = constants.data_path(cfg["chip"])
    data = json.loads(path.read_text())
    for n, v in values.items():
        data["constants"][n] = {"value": float(f"{v:.6g}"), "source": (
            f"fitted by benchmarks/calibrate_perf.py to {len(points)} published step times "
            f"({', '.join('B' + str(p['batch']) for p in points)}; mkc/perf/data/"
            "calibration_points.json)")}
    data["calibration"] = {
        "reference": cfg["reference"], "spec": cfg["spec"],
        "tokens_in_cache": cfg.get("tokens_in_cache"), "fitted": list(values),
        "dma_queues": queues,
        "routing": "expected over uniform routing: the slowest expert group of the reduce peers "
                   "(mkc/perf/routing.py), steps at the two whole expert counts around it "
                   "weighted",
        "method": "Newton on log step time, finite differences; as many points as constants "
                  "makes the fit exact, so these errors show the fit converged, not that the "
                  "model predicts (the hold-out does)",
        "points": [p | {"modelled_step_s": float(f"{p['modelled_step_s']:.6g}"),
                        "error_percent": round(p["error_percent"], 3)} for p in points],
        "holdout": ho,
        "speculative_holdout": spec,
        "dma_queues_sweep": sweep,
        "command": ".venv/bin/python benchmarks/calibrate_perf.py"}
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

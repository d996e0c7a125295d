"""Run the step-time model on a checked schedule and report it (text and JSON)."""
from __future__ import annotations

from typing import Any

from mkc import cost, ir, target
from mkc.perf import constants
from mkc.perf.sim import CAUSES, Model, Result, simulate
from mkc.trace import TraceOptions, build_trace


def experts_per_layer(s: ir.ScheduleIR, batch: int) -> int | None:
    """Routed experts a rank runs per MoE layer under uniform routing (as the HBM floor
    assumes), rounded; None for a model without routed experts."""
    if not s.experts:
        return None
    return max(1, round(cost.expected_local_experts(s, batch)))


def perf_trace(s: ir.ScheduleIR, batch: int, tokens: int) -> list:
    """The checked trace, unrolled for the model: the same builder and program order, with op
    and collective events, copies sized at `batch`, the whole KV stream over `tokens` and the
    expected routed experts (the checks use the worst case), and every ring tile (the checks
    read each run cut to warm-up, a period and tail)."""
    return build_trace(s, TraceOptions(batch=batch, experts=experts_per_layer(s, batch),
                                       kv_tokens=tokens, compute=True, whole_ring=True))


def step_model(s: ir.ScheduleIR, batch: int, tokens: int, rates: constants.Rates | None = None,
               events: list | None = None, keep_timeline: bool = True) -> Result:
    rates = rates or constants.rates(s.chip)
    events = events if events is not None else perf_trace(s, batch, tokens)
    return simulate(Model(s, batch, tokens, rates), events, keep_timeline=keep_timeline)


def calibration_note(chip: str) -> str:
    cal = constants.calibration(chip)
    if not cal:
        return f"uncalibrated: {chip} constants are priors (mkc/perf/data/{chip}.json)"
    pts = "; ".join(f"B{p['batch']} {p['published_step_s'] * 1e3:.2f} ms published, "
                    f"{p['modelled_step_s'] * 1e3:.2f} modelled ({p['error_percent']:+.1f}%)"
                    for p in cal["points"])
    return (f"calibrated: {', '.join(cal['fitted'])} fitted to {cal['reference']} ({pts}); "
            f"mkc/perf/data/{chip}.json")


def run(s: ir.ScheduleIR, batch: int | None = None, tokens: int | None = None
        ) -> dict[str, Any]:
    """The modelled step of `s` at `batch` (default: the spec's largest) with `tokens` cached
    (default: the spec's context), as a JSON-ready dict."""
    batch = batch or s.batch_max
    tokens = s.context if tokens is None else tokens
    rates = constants.rates(s.chip)
    res = step_model(s, batch, tokens, rates, keep_timeline=False)
    floor = cost.step_floor_seconds(s, target.chip(s.chip).hbm_bytes_per_s, batch, tokens)
    return {
        "modelled": True,
        "calibration": calibration_note(s.chip),
        "schedule": s.name, "model": s.model, "chip": s.chip, "topology": s.topology,
        "batch": batch, "tokens_in_cache": tokens,
        "routed_experts_per_layer": experts_per_layer(s, batch),
        "step_seconds": res.step_s,
        "tokens_per_s": batch / res.step_s,
        "hbm_floor_seconds": floor,
        "percent_of_hbm_floor": 100 * floor / res.step_s,
        "by_cause_seconds": res.by_cause,
        "by_kind_seconds": res.by_kind,
        "stalls": [{"buffer": st.buffer, "file": st.file, "line": st.line, "kind": st.kind,
                    "seconds": st.seconds, "count": st.count, "first_at": st.where}
                   for st in res.stalls],
        "hbm_bytes": res.hbm_bytes, "copies": res.copies,
        "hbm_busy_fraction": res.hbm_busy_s / res.step_s,
        "constants": {k: {"value": getattr(rates, k), "source": rates.provenance.get(k, "")}
                      for k in constants.Rates.__dataclass_fields__
                      if k not in ("chip", "provenance")},
    }


def table(rep: dict[str, Any], top_stalls: int = 8) -> str:
    ms = lambda x: f"{x * 1e3:8.3f}"     # noqa: E731
    step = rep["step_seconds"]
    lines = [
        f"{rep['schedule']} ({rep['model']}) on {rep['topology']}, batch {rep['batch']}, "
        f"{rep['tokens_in_cache']} cached tokens"
        + (f", {rep['routed_experts_per_layer']} routed experts per MoE layer per core"
           if rep["routed_experts_per_layer"] else ""),
        f"modelled step: {step * 1e3:.3f} ms, {rep['tokens_per_s']:.0f} tok/s (modelled), "
        f"{rep['percent_of_hbm_floor']:.1f}% of the HBM floor ({rep['hbm_floor_seconds'] * 1e3:.3f} ms); "
        f"HBM busy {100 * rep['hbm_busy_fraction']:.0f}% of the step",
        f"  {rep['calibration']}",
        "modelled time by layer kind and cause (ms):",
        f"  {'kind':<10}" + "".join(f"{c:>19}" for c in CAUSES) + f"{'total':>10}",
    ]
    order = ["prologue"] + [k for k in rep["by_kind_seconds"] if k not in ("prologue", "epilogue")] \
        + ["epilogue"]
    for k in order:
        row = rep["by_kind_seconds"].get(k)
        if row is None:
            continue
        lines.append(f"  {k:<10}" + "".join(f"{ms(row[c]):>19}" for c in CAUSES)
                     + f"{ms(sum(row.values())):>10}")
    tot = rep["by_cause_seconds"]
    lines.append(f"  {'total':<10}" + "".join(f"{ms(tot[c]):>19}" for c in CAUSES)
                 + f"{ms(step):>10}")
    lines.append("  weight streaming: compute with HBM copies in flight under it; exposed compute: "
                 "compute with HBM idle; stalls: waits that blocked compute")
    if rep["stalls"]:
        lines.append("largest stalls (modelled; waits that blocked compute):")
        for st in rep["stalls"][:top_stalls]:
            lines.append(f"  {ms(st['seconds'])} ms  {st['count']:5d} waits  {st['buffer']:<24} "
                         f"{st['file']}:{st['line']}  ({st['kind']}; first at {st['first_at']})")
    return "\n".join(lines)

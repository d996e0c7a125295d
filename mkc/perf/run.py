"""Run the step-time model on a checked schedule and report it (text and JSON)."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mkc import cost, ir, target
from mkc.perf import constants, routing
from mkc.perf.sim import CAUSES, Model, Result, blend, merged_op, simulate
from mkc.perf.work import KernelWork, kernel_work
from mkc.trace import TraceOptions, build_trace


# How a step's rows route (`mkc perf --routing`), as the rows that pick experts independently:
# every row (uniform routing, the default), the rows of one sequence alike (a verify step's
# drafts, as if consecutive tokens picked the same experts), or every row alike (one prompt on
# every row, as the published Muse Spark steps were run): bounds, not a model of correlation.
ROUTINGS = {"rows": lambda batch, sequences: batch,
            "sequences": lambda batch, sequences: sequences or batch,
            "one": lambda batch, sequences: 1}


# What each routing assumes, said whole in the JSON report.
ROUTING_ASSUMPTIONS = {
    "rows": "uniform routing, each row picking its experts independently: an upper bound on the "
            "distinct experts a step streams; real prompts' picks overlap more (--routing "
            "sequences or one: the bounds below)",
    "sequences": "uniform routing, the rows of one sequence picking alike (a verify step's "
                 "drafts as if consecutive tokens picked the same experts): a lower bound for "
                 "independent sequences",
    "one": "every row picking alike (one prompt on every row, as the published Muse Spark "
           "steps ran): the fewest distinct experts"}
ROUTING_NOTES = {"rows": ", each row picking independently: an upper bound on distinct experts, "
                         "real prompts' picks overlap more (--routing sequences or one bound them)",
                 "sequences": ", each sequence's rows alike", "one": ", every row alike"}


def expected_experts(s: ir.ScheduleIR, batch: int) -> float | None:
    """Routed experts the slowest rank runs per MoE layer, expected under uniform routing: the
    maximum over the expert groups of the ranks that all-reduce the experts' output together
    (the step waits for the slowest; `mkc.perf.routing`). None without routed experts."""
    return routing.slowest_group_experts(s, batch)


def experts_per_layer(s: ir.ScheduleIR, batch: int) -> int | None:
    """The expected slowest-group experts per MoE layer rounded (at least 1): what one
    simulated step runs when a caller asks for a single one (pictures, `perf_trace`)."""
    x = expected_experts(s, batch)
    return None if x is None else max(1, round(x))


def perf_trace(s: ir.ScheduleIR, batch: int, tokens: int, experts: int | None = None,
               sequences: int | None = None) -> list:
    """The checked trace, unrolled for the model: the same builder and program order, with op
    and collective events, copies sized at `batch`, the whole KV stream over `tokens` and
    `experts` routed experts per MoE layer (default: the expected slowest group's, rounded;
    the checks use the worst case), and every ring tile (the checks read each run cut to
    warm-up, a period and tail)."""
    if experts is None:
        experts = experts_per_layer(s, batch)
    return build_trace(s, TraceOptions(batch=batch, sequences=sequences, experts=experts,
                                       kv_tokens=tokens, compute=True, whole_runs=True))


def expert_mix(s: ir.ScheduleIR, batch: int) -> list[tuple[int, float]]:
    """The simulated steps whose weighted sum is the expected step: [(experts per layer,
    weight)]. A fractional expected count x lies between two whole ones, weighted so their mean
    is x (linear interpolation; exact where the step grows linearly with the experts a layer
    runs). [(0, 1.0)] without routed experts."""
    x = expected_experts(s, batch)
    if x is None:
        return [(0, 1.0)]
    local = s.per_rank["local_experts"]
    x = min(max(x, 1.0), float(local))
    lo = math.floor(x)
    w = x - lo
    if w < 1e-9:
        return [(lo, 1.0)]
    return [(lo, 1.0 - w), (lo + 1, w)]


def compiled_measure(s: ir.ScheduleIR, batch: int, sequences: int | None = None,
                     compile_missing: bool = False) -> dict:
    """The `mkc.perf.bundles` measure of the kernel at `batch` rows (a verify kernel for
    `sequences`): cached, or compiled now with `compile_missing`; else BundleError."""
    from mkc.perf import bundles
    kernel = "verify" if sequences else "decode"
    return bundles.bundle_report(s, kernel, sequences or batch, compile_missing=compile_missing)


def step_model(s: ir.ScheduleIR, batch: int, tokens: int, rates: constants.Rates | None = None,
               events: list | None = None, keep_timeline: bool = True,
               traces: dict | None = None, sequences: int | None = None,
               compiled: dict | None = None, compiled_work: KernelWork | None = None,
               routed_rows: int | None = None) -> Result:
    """The modelled step at `batch` rows (as fewer `sequences`: a verify step) with `tokens`
    cached. With `events`, that trace simulated
    once. Otherwise the expectation over routing: the steps of `expert_mix` simulated and
    weighed (`sim.blend`; a picture shows the nearer one, `Result.concrete()`). `traces`, if
    given, caches the traces built, by (batch, tokens, experts per layer). With `compiled` (a
    `compiled_measure`), work is priced by the cycles libtpu scheduled (`sim.Model.compiled`)
    at the chip's rates unless `rates` are given; `compiled_work` is the counted work of the
    kernel `compiled` measured when that is another geometry of `s` (`sim.Model`). The experts
    routed as `routed_rows` independent rows pick them (default `batch`: `ROUTINGS`)."""
    rates = rates or constants.rates(s.chip)
    routed_rows = routed_rows or batch
    work = kernel_work(s, batch, batch // sequences if sequences else None)
    if events is not None:
        return simulate(Model(s, batch, tokens, rates, work=work, compiled=compiled,
                             compiled_work=compiled_work), events,
                        keep_timeline=keep_timeline)
    mix = expert_mix(s, routed_rows)
    parts = []
    for n, w in mix:
        key = (batch, tokens, n, sequences)
        ev = traces.get(key) if traces is not None else None
        if ev is None:
            ev = perf_trace(s, batch, tokens, experts=n or None, sequences=sequences)
            if traces is not None:
                traces[key] = ev
        res = simulate(Model(s, batch, tokens, rates, work=work, compiled=compiled,
                             compiled_work=compiled_work), ev,
                       keep_timeline=keep_timeline)
        res.experts = n if n else None
        parts.append((n, w, res))
    if len(parts) == 1:
        return parts[0][2]
    return blend(parts, expected_experts(s, routed_rows))


def validation_note(chip: str) -> str:
    """Where the chip's constants come from and the model's error at every published step
    (or where they were carried from)."""
    val = constants.validation(chip)
    data = f"mkc/perf/data/{chip}.json"
    clock = constants.rates(chip).clock_hz
    if not val:
        base = constants.carried_from(chip)
        own = ", ".join(constants.load_data(chip)["own"])
        return (f"unvalidated on {chip}: compute at the {clock / 1e9:.3f} GHz clock JAX's table "
                f"implies; {own} from {chip}'s published figures; every other constant"
                + (f" carried from {base}" if base else " a prior") + f" ({data})")
    consts = constants.load_data(chip)["constants"]
    assumed = sorted(k for k, c in consts.items() if c["source"].startswith("assumed"))
    pts = "; ".join(f"{p['step']} {p['published_step_s'] * 1e3:.2f} ms published, "
                    f"{p['modelled_step_s'] * 1e3:.2f} modelled ({p['error_percent']:+.1f}%)"
                    for p in val["points"])
    worst_micro = _worst_percent(m["error_percent"] for m in val["micro"])
    hold = val.get("hold_out")
    held = (f"; held out, nothing changed to meet them: {hold['reference']}, "
            f"{len(hold['points'])} steps off by {min(p['error_percent'] for p in hold['points']):+.1f}"
            f"% .. {max(p['error_percent'] for p in hold['points']):+.1f}%" if hold else "")
    return (f"validated, nothing fitted: compute at the {clock / 1e9:.3f} GHz clock JAX's table "
            f"implies (assumed), never faster than the MXU's measured weight pushes; "
            f"{len(consts) - len(assumed)} constants measured on {chip}, "
            f"{len(assumed)} assumed ({', '.join(assumed)}); against {val['reference']} "
            f"({pts}){held}; {len(val['micro'])} published micro-cases within {worst_micro}%; "
            f"{data}")


def validation_caveat(chip: str) -> str:
    """One line on how far to trust the constants, for every picture and trace of a step
    (`validation_note` is the whole story)."""
    data = f"mkc/perf/data/{chip}.json"
    val = constants.validation(chip)
    if not val:
        base = constants.carried_from(chip)
        return (f"unvalidated on {chip}: no {chip} step measured ("
                + (f"constants carried from {base}; " if base else "priors; ") + f"{data})")
    worst = _worst_percent(p["error_percent"] for p in published_steps(val))
    return (f"nothing fitted; off by up to {worst}% at the published {chip} steps ({data})")


def published_steps(val: dict) -> list[dict]:
    """Every published step the validation priced: the calibration kernel's and the
    hold-out's."""
    return val["points"] + val.get("hold_out", {}).get("points", [])


def _worst_percent(errors: Iterable[float]) -> str:
    """The largest error, rounded up to a tenth: a caveat never states less than the worst."""
    return f"{math.ceil(10 * max(abs(e) for e in errors) - 1e-9) / 10:.1f}"


@dataclass
class Modelled:
    """One `mkc perf` run: the step simulated (an expectation over routing or one simulated
    step) and what it was asked at. The text, --json, --plot and --trace all read `res`."""

    s: ir.ScheduleIR
    res: Result
    batch: int
    tokens: int
    sequences: int | None
    verify_rows: int | None
    acceptance: float | None
    rates: constants.Rates
    measure: dict | None
    counted_because: str = ""      # why the step is counted, not priced by a compiled measure
    routing: str = "rows"          # `ROUTINGS`

    @property
    def routed_rows(self) -> int:
        return ROUTINGS[self.routing](self.batch, self.sequences)


def kernel_measure(s: ir.ScheduleIR, batch: int, sequences: int | None = None,
                   verify_rows: int | None = None, compiled: bool | None = None,
                   on_compile=None) -> tuple[dict | None, str]:
    """The compiled measure that prices the kernel at `batch` rows (a verify kernel for
    `sequences`), or None and why: with `compiled` None, the cached or shipped measure if there
    is one (no compile); True, compiled when missing (`on_compile()` first); False, none."""
    if compiled is False:
        return None, "asked for (--counted)"
    from mkc.perf import bundles
    try:
        return bundles.bundle_report(s, "verify" if sequences else "decode", sequences or batch,
                                     compile_missing=bool(compiled), verify_rows=verify_rows,
                                     on_compile=on_compile), ""
    except bundles.BundleError as e:
        if compiled:
            raise
        if e.setting == "verify":
            return None, str(e)
        return op_measure(s, batch, sequences, str(e) + " (--compiled compiles it)")


def op_measure(s: ir.ScheduleIR, batch: int, sequences: int | None = None,
               whole: str = "") -> tuple[dict | None, str]:
    """The kernel priced per op (`mkc.perf.op_measures.assemble`): each op body's measure by
    its key, compiled alone when missing; or None and why (`whole`: why no whole-kernel
    measure) when not one op could be priced compiled (no libtpu for the generation)."""
    from mkc.perf import bundles, op_measures
    if not bundles.libtpu_version():
        return None, "libtpu is not installed, so nothing can compile" + (
            f"; {whole}" if whole else "")
    m = op_measures.assemble(s, batch, sequences)
    if not any(r["group"] == "op" for r in m["rows"]):
        counted = m["op_level"]["ops_counted"]
        why = ("no op body of the kernel is measured, and compiling one alone is off "
               "(MKC_OP_COMPILE=0)" if not op_measures.compiling() else
               "no op of the kernel could be compiled alone: "
               + "; ".join(f"{k}: {v}" for k, v in sorted(counted.items())[:3]))
        return None, f"{whole}; {why}" if whole else why
    return m, ""


def model(s: ir.ScheduleIR, batch: int | None = None, tokens: int | None = None,
          verify_rows: int | None = None, acceptance: float | None = None,
          compiled: bool | None = None, keep_timeline: bool = False,
          on_compile=None, routing: str = "rows") -> Modelled:
    """The modelled step of `s` at `batch` (default: the spec's largest) with `tokens` cached
    (default: the spec's context). With `verify_rows` R, its verify step of R rows for each of
    `batch` sequences (default: the spec's fewest), whose tokens per second count `acceptance`
    tokens per sequence and launch (default R: every draft right). `keep_timeline` for
    pictures of that same step. Priced by the kernel's compiled measure (`mkc.perf.bundles`)
    where one is cached, else counted; `compiled` as `kernel_measure` takes it. `routing`: how
    the rows pick experts (`ROUTINGS`)."""
    sequences = None
    if verify_rows:
        sequences = batch or s.verify_sequences[0]
        batch = sequences * verify_rows
    batch = batch or s.batch_max
    tokens = s.context if tokens is None else tokens
    measure, why = kernel_measure(s, batch, sequences, verify_rows, compiled, on_compile)
    rates = constants.rates(s.chip)
    res = step_model(s, batch, tokens, rates, keep_timeline=keep_timeline, sequences=sequences,
                     compiled=measure, routed_rows=ROUTINGS[routing](batch, sequences))
    return Modelled(s, res, batch, tokens, sequences, verify_rows, acceptance, rates, measure,
                    why, routing)


def run(s: ir.ScheduleIR, batch: int | None = None, tokens: int | None = None,
        verify_rows: int | None = None, acceptance: float | None = None,
        compiled: bool | None = None) -> dict[str, Any]:
    """`report` of `model` (see there), as a JSON-ready dict."""
    return report(model(s, batch, tokens, verify_rows, acceptance, compiled))


def stall_seconds(res: Result) -> float:
    """The stall total of a modelled step: every wait that blocked compute, the prologue's and
    epilogue's included (`sim` books them all to "stalls"), so the table's column, the stall
    list, the picture's stall row and the trace's stall track give one figure for one step."""
    return res.by_cause["stalls"]


def hbm_bytes_by_class(s: ir.ScheduleIR, batch: int, tokens: int,
                       sequences: int | None = None, routed_rows: int | None = None) -> dict[str, int]:
    """Bytes the slowest core moves in HBM per step, by class (`cost.hbm_traffic`), largest
    first: with routed experts, the slowest expert group's (the step waits for it) rather than
    the mean core's."""
    rows = routed_rows or batch
    traffic = cost.hbm_traffic(s, batch, tokens, sequences, rows)
    mean_key = "routed experts (uniform routing)"
    if s.experts and mean_key in traffic:
        mean = cost.expected_local_experts(s, rows)
        routed = traffic.pop(mean_key)
        traffic["routed experts (slowest core)"] = round(routed * expected_experts(s, rows) / mean)
    return dict(sorted(((k, v) for k, v in traffic.items() if v), key=lambda kv: -kv[1]))


# A step this close to the model's HBM ceiling is bound by streaming its bytes: the rest is
# within what per-copy costs and the first copies' latency leave.
HBM_BOUND_SHARE = 0.9
# What bounds a step, and what can shorten it: streaming exactly when the step is within
# HBM_BOUND_SHARE of the ceiling, else the other cause that takes the most time (a step further
# from the ceiling loses that time to something other than its bytes, even where streaming is its
# largest cause).
BOUNDS = {
    "weight streaming": ("HBM streaming", "only fewer bytes help"),
    "exposed compute": ("compute", "compute runs with HBM idle: less work per row, or more "
                                   "copies in flight under it"),
    "stalls": ("stalls", "waits on copies that land late with HBM not saturated: start them "
                         "earlier or deepen the ring (`mkc tune` searches both)"),
    "collectives": ("collectives", "fewer or smaller collectives (all-reduce algorithm, wire "
                                   "format, sharding)"),
    "prologue/epilogue": ("the launch and the tail", "a fixed cost a step: more rows a step "
                                                     "spread it"),
}


def verdict(m: Modelled) -> dict[str, Any]:
    """What bounds the modelled step and how far it is from the model's own ceiling: the
    slowest core's bytes at the bandwidth the model lets copies reach (peak x hbm_efficiency),
    with those bytes by class. A step at that ceiling gets nothing from a better schedule."""
    res, rates = m.res, m.rates
    by_class = hbm_bytes_by_class(m.s, m.batch, m.tokens, m.sequences, m.routed_rows)
    ceiling = sum(by_class.values()) / rates.hbm_stream_bytes_per_s
    share = ceiling / res.step_s
    cause = "weight streaming" if share >= HBM_BOUND_SHARE else \
        max((c for c in CAUSES if c != "weight streaming"), key=lambda c: res.by_cause[c])
    bound, advice = BOUNDS[cause]
    gap = max(0.0, res.step_s - ceiling)
    bytes_text = ", ".join(f"{k} {_size(v)}" for k, v in by_class.items())
    text = (f"bound by {bound}, at {100 * share:.1f}% of the model's HBM ceiling "
            f"({ceiling * 1e3:.3f} ms: the step's bytes at {100 * rates.hbm_efficiency:.1f}% of "
            f"peak, hbm_efficiency"
            + (f"; {gap * 1e3:.3f} ms above it" if cause != "weight streaming" else "")
            + f"): {advice}; bytes by class (this core, a step): {bytes_text}")
    return {"bound_by": bound, "cause": cause, "advice": advice,
            "percent_of_hbm_ceiling": 100 * share, "hbm_ceiling_seconds": ceiling,
            "hbm_efficiency": rates.hbm_efficiency, "seconds_above_ceiling": gap,
            # largest first, as a list: JSON output sorts an object's keys
            "hbm_bytes_by_class": [{"class": k, "bytes": v} for k, v in by_class.items()],
            "text": text}


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n:.0f} B"


def report(m: Modelled) -> dict[str, Any]:
    """The modelled step as a JSON-ready dict (the text is `table` of it)."""
    s, res, batch, tokens, sequences = m.s, m.res, m.batch, m.tokens, m.sequences
    measure, rates, verify_rows = m.measure, m.rates, m.verify_rows
    bw = target.chip(s.chip).hbm_bytes_per_s
    rows = m.routed_rows
    floor = cost.step_floor_seconds(s, bw, batch, tokens, sequences, rows)
    emitted = batch if not verify_rows else sequences * (m.acceptance or verify_rows)
    slowest_floor = floor
    if s.experts:
        # the floor counts the mean core's routed experts; the slowest core moves more
        mean = cost.expected_local_experts(s, rows)
        routed = cost.hbm_traffic(s, batch, tokens, routed_rows=rows)["routed experts (uniform routing)"]
        slowest_floor += routed * (expected_experts(s, rows) / mean - 1) / bw
    pictured = res.concrete()
    return {
        "modelled": True,
        "priced_by": (op_priced_by(measure) if measure and "op_level" in measure else
                      f"compiled: the cycles libtpu {measure['libtpu']} scheduled for the "
                      f"{measure['kernel']} kernel at {measure['batch']} "
                      f"{'sequences' if sequences else 'rows'} (mkc.perf.bundles), at a "
                      f"{rates.clock_hz / 1e9:.3f} GHz clock" if measure else
                      "counted: the traced kernel's work at the chip's rates (mkc.perf.work; "
                      f"the MXUs loading weights at their push rate), {m.counted_because}"),
        "ops_counted": ops_counted(measure),
        "collectives_counted": (measure or {}).get("op_level", {}).get("collectives_counted", []),
        "validation": validation_note(s.chip),
        "schedule": s.name, "model": s.model, "chip": s.chip, "topology": s.topology,
        "batch": batch, "tokens_in_cache": tokens,
        "verify": ({"rows": verify_rows, "sequences": sequences,
                    "acceptance": m.acceptance or verify_rows} if verify_rows else None),
        "verdict": verdict(m),
        "routed_experts_per_layer": res.experts,
        "routed_experts_per_layer_mean": (cost.expected_local_experts(s, rows)
                                          if s.experts else None),
        "routing": m.routing,
        "routing_assumption": ROUTING_ASSUMPTIONS[m.routing] if s.experts else None,
        "routed_experts_simulated": [{"experts": n, "weight": w} for n, w in res.parts]
                                    or ([{"experts": res.experts, "weight": 1.0}]
                                        if res.experts else []),
        "step_seconds": res.step_s,
        "stall_seconds": stall_seconds(res),
        # the one simulated step --plot and --trace draw, when the step is an expectation
        "pictured_step": ({"routed_experts_per_layer": pictured.experts,
                           "step_seconds": pictured.step_s,
                           "stall_seconds": stall_seconds(pictured)}
                          if pictured is not res else None),
        "tokens_per_s": emitted / res.step_s,
        "hbm_floor_seconds": floor,
        "percent_of_hbm_floor": 100 * floor / res.step_s,
        "percent_of_peak_bandwidth": 100 * res.hbm_bytes / (res.step_s * bw),
        "slowest_core_hbm_floor_seconds": slowest_floor,
        "by_cause_seconds": res.by_cause,
        "by_kind_seconds": res.by_kind,
        "stalls": [{"buffer": st.buffer, "file": st.file, "line": st.line, "kind": st.kind,
                    "seconds": st.seconds, "count": st.count, "first_at": st.where}
                   for st in res.stalls],
        "op_costs": op_costs(res, batch, measure),
        "hbm_bytes": res.hbm_bytes, "copies": res.copies,
        "hbm_busy_fraction": res.hbm_busy_s / res.step_s,
        "constants": {k: {"value": getattr(rates, k), "source": rates.provenance.get(k, "")}
                      for k in constants.Rates.__dataclass_fields__
                      if k not in ("chip", "provenance")},
    }


def ops_counted(measure: dict | None) -> dict[str, str]:
    """What an op-level measure prices by the count, not compiled: ops, and the collectives
    when no whole-kernel measure of the spec at these rows gives their cycles."""
    level = (measure or {}).get("op_level", {})
    return level.get("ops_counted", {}) | {
        c: "counted sums: no whole-kernel measure of this spec at these rows"
        for c in level.get("collectives_counted", [])}


def op_priced_by(measure: dict) -> str:
    from mkc.perf.op_measures import describe
    return describe(measure)


# How far the count has been from the compiled price (issue 51: the shipped specs and their
# neighbours, counted against compiled): a report priced by the count says so first.
COUNTED_OFF = "1.7-4.2x"
# Steps whose collectives are priced by their counted sums against the whole-kernel price of
# the same kernel (Muse Spark at batches without a whole-kernel measure).
COUNTED_COLLECTIVES_OFF = "1.0-1.3 % under"


def counted_warning(rep: dict[str, Any]) -> str | None:
    """The line a report priced by the count, wholly or for some ops or collectives, opens
    with; None when every op and collective is priced compiled."""
    if rep["priced_by"].startswith("counted"):
        return (f"COUNTED PRICE, not compiled: counted prices have been {COUNTED_OFF} off the "
                f"compiled price of the same kernel and can reverse rankings (why: see `priced by`)")
    collectives = set(rep.get("collectives_counted", ()))
    ops = sorted(set(rep.get("ops_counted") or ()) - collectives)
    if not ops and not collectives:
        return None
    parts = ([f"{len(ops)} op(s) counted, not compiled ({', '.join(ops)})"] if ops else []) + (
        [f"{len(collectives)} collective(s) priced by their counted sums: no whole-kernel "
         f"measure of this spec at these rows ({', '.join(sorted(collectives))})"]
        if collectives else [])
    why = (f"counted ops have been {COUNTED_OFF} off the compiled price of the same kernel and "
           f"can reverse rankings" if ops else
           f"steps so priced have been {COUNTED_COLLECTIVES_OFF} the whole-kernel price")
    return f"PARTLY COUNTED PRICE: {'; '.join(parts)}: {why} (why: see `priced by`)"


def op_costs(res: Result, batch: int, measure: dict | None = None) -> list[dict[str, Any]]:
    """One entry per op and layer kind, costliest first: its work as counted from the emitted
    kernel (per call: per batch row for vector work, matrix values as loaded into the MXU),
    where its price came from (with `measure`, the compiled kernel's row, or why it was
    counted), and its modelled compute over the step."""
    work = res.work
    rows = {r["key"] for r in (measure or {}).get("rows", [])}
    out = []
    for (kind, op), c in res.op_costs.items():
        if not c.calls:
            continue
        ow = work.op(kind, op)
        source = work.source_of(kind, op)
        if ow.dynamic_loop:
            source += " (a loop of run-time length inside it counted once per call)"
        level = (measure or {}).get("op_level", {})
        if measure is not None and level:
            row = f"{kind}.{op}"
            source = (f"compiled per op: {level['origin'][row]} ({source})"
                      if row in level["origin"] else
                      f"counted: {level['ops_counted'].get(row, 'no measure')} ({source})")
        elif measure is not None:
            source = (f"compiled: row {kind}.{op} of libtpu {measure['libtpu']}'s LLO of the "
                      f"{measure['kernel']} kernel ({source})" if f"{kind}.{op}" in rows else
                      f"compiled: merged by libtpu into its neighbours' rows, priced in them "
                      f"({source})" if merged_op(measure, kind, op) else
                      f"counted: the compiled kernel has no row {kind}.{op} ({source})")
        out.append({
            "op": op, "layer_kind": kind, "calls": c.calls, "source": source,
            "vector_ops_per_row": c.vector / (c.calls * batch),
            "transcendental_ops_per_row": c.transcendental / (c.calls * batch),
            "matrix_values": c.matrix_values / c.calls,
            "weight_values_read": c.weight_values / c.calls,
            "kv_tiles": c.kv_tiles / c.calls,
            "seconds": c.seconds, "seconds_per_call": c.seconds / c.calls})
    return sorted(out, key=lambda e: (-e["seconds"], e["layer_kind"], e["op"]))


# What the table's and the picture's two HBM percentages are (they differ by the bytes the
# floor does not count: re-reads, the slowest core's extra experts, per-copy overhead).
HBM_PERCENTAGES = ("% of the HBM floor: the floor (the step's bytes at peak bandwidth) over the "
                   "modelled step; % of peak bandwidth: bytes moved over (step x peak); busy: "
                   "time with a copy in flight")


def table(rep: dict[str, Any], top_stalls: int = 8) -> str:
    ms = lambda x: f"{x * 1e3:8.3f}"     # noqa: E731
    step = rep["step_seconds"]
    warning = counted_warning(rep)
    lines = ([warning] if warning else []) + [
        f"{rep['schedule']} ({rep['model']}) on {rep['topology']}, "
        + (f"batch {rep['batch']}" if not rep.get("verify") else
           f"verify step of {rep['verify']['rows']} rows x {rep['verify']['sequences']} sequences "
           f"(tok/s at {rep['verify']['acceptance']:g} accepted per sequence and launch)")
        + f", {rep['tokens_in_cache']} cached tokens"
        + (f", {rep['routed_experts_per_layer']:.2f} routed experts per MoE layer on the slowest "
           f"core (expected under uniform routing{ROUTING_NOTES[rep.get('routing', 'rows')]}; mean core "
           f"{rep['routed_experts_per_layer_mean']:.2f})"
           if rep["routed_experts_per_layer"] else ""),
        f"modelled step: {step * 1e3:.3f} ms, {rep['tokens_per_s']:.0f} tok/s (modelled); "
        f"{rep['percent_of_hbm_floor']:.1f}% of the HBM floor ({rep['hbm_floor_seconds'] * 1e3:.3f} ms"
        + (f"; the slowest core's {rep['slowest_core_hbm_floor_seconds'] * 1e3:.3f} ms"
           if rep["routed_experts_per_layer"] else "") + "); "
        f"{rep['percent_of_peak_bandwidth']:.1f}% of peak bandwidth; "
        f"HBM busy {100 * rep['hbm_busy_fraction']:.0f}% of the step, {rep['copies']} HBM copies",
        f"verdict: {rep['verdict']['text']}",
        f"  {HBM_PERCENTAGES}",
        f"  priced by {rep['priced_by']}",
        f"  {rep['validation']}",
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
                 "compute with HBM idle; stalls: every wait that blocked compute (the same "
                 "total as --plot's and --trace's stall rows); prologue/epilogue: the launch, "
                 "the tail's compute and collectives")
    if pic := rep.get("pictured_step"):
        lines.append(f"  an expectation over routing; --plot and --trace draw the step of "
                     f"{pic['routed_experts_per_layer']} routed experts per MoE layer: "
                     f"{ms(pic['step_seconds']).strip()} ms, stalls "
                     f"{ms(pic['stall_seconds']).strip()} ms")
    if rep.get("op_costs"):
        if rep["priced_by"].startswith("compiled"):
            lines.append("costliest ops (modelled compute over the step, priced by the cycles "
                         "libtpu scheduled; `mkc perf --bundles --op KIND.OP` shows why):")
            for e in rep["op_costs"][:3]:
                lines.append(f"  {ms(e['seconds'])} ms  {e['layer_kind']}.{e['op']:<18} "
                             f"{e['calls']:5.0f} calls  ({e['source']})")
        else:
            lines.append("costliest ops (modelled compute over the step, counted from the "
                         "emitted kernel):")
            for e in rep["op_costs"][:3]:
                lines.append(f"  {ms(e['seconds'])} ms  {e['layer_kind']}.{e['op']:<18} "
                             f"{e['vector_ops_per_row']:12.0f} vector ops/row, "
                             f"{e['matrix_values']:12.0f} MXU values a call  ({e['source']})")
    if rep["stalls"]:
        lines.append("largest stalls (modelled; waits that blocked compute):")
        for st in rep["stalls"][:top_stalls]:
            lines.append(f"  {ms(st['seconds'])} ms  {st['count']:5d} waits  {st['buffer']:<24} "
                         f"{st['file']}:{st['line']}  ({st['kind']}; first at {st['first_at']})")
    return "\n".join(lines)

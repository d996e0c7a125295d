"""Benchmark of the step-time model (`mkc perf`): how long simulating one full decode step
takes, per shipped spec and batch, split into building the model's trace and replaying it.
A MoE step is the expectation over routing: the steps at the two whole expert counts around
the slowest group's expected count, each traced and replayed (both counted). Prints medians
over several runs, the modelled step times, and the command that reproduces each number. The
step times are modelled, not measured.

    .venv/bin/python benchmarks/perf_sim.py [--repeats N] [--timeline] [--json]
    .venv/bin/python benchmarks/perf_sim.py --tuned [--json]
    .venv/bin/python benchmarks/perf_sim.py --transfer [MODEL ...] [--json]

--tuned compares each tuned candidate in benchmarks/data/tuned/ (written by `mkc tune`) with
the spec it was tuned from (benchmarks/data/untuned/: the shipped specs have since taken some
of the changes), at the spec's smallest and largest batch, with the DMA engine round-robining
among the copies in flight (measured on TPU7x, `dma_queues` 0) and with 1, 2 and 4 in-order
queues instead: a gain that holds for one discipline only is the engine model's, not the
schedule's. Both are priced by the shipped spec's compiled measure (per weight value read, as
`mkc tune` prices candidates).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPECS = {"Kimi K3": "schedules/kimi_k3.sched", "Qwen 3.8 27B": "schedules/qwen3_8_27b.sched",
         "Qwen3.5 35B-A3B": "schedules/qwen3_5_35b_a3b.sched",
         "Qwen3.5 397B-A17B": "schedules/qwen3_5_397b_a17b.sched"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--timeline", action="store_true",
                    help="also record the per-track timeline (what a trace exporter reads); "
                         "`mkc perf` does not")
    ap.add_argument("--tuned", action="store_true",
                    help="compare the tuned specs in benchmarks/data/tuned/ with their inputs per DMA queue "
                         "count")
    ap.add_argument("--transfer", nargs="*", metavar="MODEL",
                    help="test how `mkc tune` prices a candidate: each untuned and tuned spec "
                         "priced by the shipped spec's compiled measure against its own compile "
                         "(compiles each; default models: Qwen 3.8 27B)")
    args = ap.parse_args()
    if args.tuned:
        return tuned(args.json)
    if args.transfer is not None:
        return transfer(args.transfer or ["Qwen 3.8 27B"], args.json)
    from mkc.compiler import check_spec
    from mkc.perf import constants
    from mkc.perf.run import expected_experts, expert_mix, perf_trace, step_model
    from mkc.perf.sim import blend

    rows = []
    for name, spec in SPECS.items():
        c = check_spec(ROOT / spec)
        rates = constants.rates(c.ir.chip)
        for batch in sorted({c.ir.batch_min, c.ir.batch_max}):
            mix = expert_mix(c.ir, batch)
            trace_s, sim_s, steps, n = [], [], [], 0
            for _ in range(args.repeats):
                tt = ts = 0.0
                parts = []
                for experts, w in mix:
                    t0 = time.perf_counter()
                    events = perf_trace(c.ir, batch, c.ir.context, experts=experts or None)
                    t1 = time.perf_counter()
                    res = step_model(c.ir, batch, c.ir.context, rates, events=events,
                                     keep_timeline=args.timeline)
                    t2 = time.perf_counter()
                    tt, ts = tt + t1 - t0, ts + t2 - t1
                    parts.append((experts, w, res))
                    n = max(n, len(events))
                trace_s.append(tt)
                sim_s.append(ts)
                steps.append(parts[0][2].step_s if len(parts) == 1
                             else blend(parts, expected_experts(c.ir, batch)).step_s)
            total = [a + b for a, b in zip(trace_s, sim_s)]
            rows.append({"model": name, "spec": spec, "batch": batch, "events": n,
                         "simulated_steps": [{"experts": e, "weight": round(w, 4)}
                                             for e, w in mix if e],
                         "expected_experts": expected_experts(c.ir, batch),
                         "dma_queues": int(rates.dma_queues),
                         "trace_s": statistics.median(trace_s),
                         "replay_s": statistics.median(sim_s),
                         "total_s": statistics.median(total),
                         "modelled_step_s": steps[-1],
                         "timeline": args.timeline,
                         "reproduce": f".venv/bin/python benchmarks/perf_sim.py --repeats "
                                      f"{args.repeats}"})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"step-time model: time to simulate one full decode step as `mkc perf` does (median "
          f"of {args.repeats}{', timeline recorded' if args.timeline else ''}; the machine is "
          "shared, so expect noise)")
    queues = rows[0]["dma_queues"] if rows else 0
    engine = (f"{queues} DMA queue(s) per core" if queues
              else "the DMA engine round-robins among the copies in flight")
    print(f"  ({engine}; a MoE step weighs the steps at two whole expert counts, both traced "
          "and replayed)")
    print(f"  {'model':<18}{'batch':>6}{'experts':>9}{'steps':>6}{'events':>9}{'trace':>10}"
          f"{'replay':>10}{'total':>10}{'modelled step':>16}")
    for r in rows:
        ex = f"{r['expected_experts']:.2f}" if r["expected_experts"] else "-"
        print(f"  {r['model']:<18}{r['batch']:>6}{ex:>9}{max(1, len(r['simulated_steps'])):>6}"
              f"{r['events']:>9}{r['trace_s'] * 1e3:>8.0f}ms"
              f"{r['replay_s'] * 1e3:>8.0f}ms{r['total_s'] * 1e3:>8.0f}ms"
              f"{r['modelled_step_s'] * 1e3:>13.3f}ms")
    print(f"reproduce: .venv/bin/python benchmarks/perf_sim.py --repeats {args.repeats}"
          + (" --timeline" if args.timeline else ""))
    return 0


def transfer(models: list[str], as_json: bool) -> int:
    """A geometry priced by another's compiled measure (as `mkc tune` prices its candidates)
    against its own compiled measure: the untuned and tuned specs of each model, at its
    smallest and largest batch, by the shipped spec's measure and by their own (compiled now,
    then cached)."""
    from mkc.compiler import check_spec
    from mkc.perf.run import kernel_measure, step_model
    from mkc.perf.work import kernel_work

    rows = []
    for name in models:
        spec = SPECS[name]
        shipped = check_spec(ROOT / spec).ir
        for variant in ("untuned", "tuned"):
            path = ROOT / "benchmarks" / "data" / variant / Path(spec).name
            if not path.is_file():
                continue
            cand = check_spec(path).ir
            for batch in sorted({shipped.batch_min, shipped.batch_max}):
                measure, _ = kernel_measure(shipped, batch)
                own, _ = kernel_measure(cand, batch, compiled=True)
                lent = step_model(cand, batch, cand.context, keep_timeline=False, compiled=measure,
                                  compiled_work=kernel_work(shipped, batch)).step_s
                true = step_model(cand, batch, cand.context, keep_timeline=False,
                                  compiled=own).step_s
                rows.append({"model": name, "spec": str(path.relative_to(ROOT)), "batch": batch,
                             "priced_by_shipped_s": lent, "priced_by_own_s": true,
                             "error_percent": 100 * (lent / true - 1)})
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    print("a geometry priced by the shipped spec's compiled measure (as `mkc tune` prices "
          "candidates) against its own compile (modelled, not measured)")
    for r in rows:
        print(f"  {r['spec']:<44} B{r['batch']:<3} {r['priced_by_shipped_s'] * 1e3:8.3f} ms "
              f"vs {r['priced_by_own_s'] * 1e3:8.3f} ms  {r['error_percent']:+.2f}%")
    print("reproduce: .venv/bin/python benchmarks/perf_sim.py --transfer " +
          " ".join(f"'{m}'" for m in models))
    return 0


def tuned(as_json: bool) -> int:
    """Each tuned spec against its input, modelled at each batch and DMA queue count (module docstring)."""
    from mkc.compiler import check_spec
    from mkc.perf import constants
    from mkc.perf.run import kernel_measure, step_model
    from mkc.perf.work import kernel_work

    sweep = (0, 1, 2, 4)          # DMA queues: 0 round-robins among every copy in flight
    rows = []
    for name, spec in SPECS.items():
        cand = ROOT / "benchmarks" / "data" / "tuned" / Path(spec).name
        if not cand.is_file():
            continue
        origin = ROOT / "benchmarks" / "data" / "untuned" / Path(spec).name
        base, tuned_ = check_spec(origin).ir, check_spec(cand).ir
        shipped = check_spec(ROOT / spec).ir
        traces: dict = {id(base): {}, id(tuned_): {}}
        for q in sweep:
            rates = constants.rates(base.chip, {"dma_queues": q})
            for batch in sorted({base.batch_min, base.batch_max}):
                # both priced by the shipped spec's compiled kernel (cached), per weight value
                measure, _ = kernel_measure(shipped, batch)
                work = kernel_work(shipped, batch)
                t0, t1 = (step_model(s, batch, s.context, rates, keep_timeline=False,
                                     traces=traces[id(s)], compiled=measure,
                                     compiled_work=work).step_s for s in (base, tuned_))
                rows.append({"model": name, "tuned_from": str(origin.relative_to(ROOT)),
                             "tuned": str(cand.relative_to(ROOT)), "dma_queues": q,
                             "batch": batch,
                             "priced_by": "compiled (the shipped spec's measure)" if measure
                             else "counted", "from_step_s": t0,
                             "tuned_step_s": t1, "gain_percent": 100 * (t0 / t1 - 1)})
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    print("tuned spec against the spec it was tuned from, modelled step per DMA queue count "
          "(0: round-robin among the copies in flight, as measured; modelled, not measured)")
    print(f"  {'model':<18}{'queues':>7}{'batch':>6}{'from':>11}{'tuned':>11}{'gain':>8}")
    for r in rows:
        print(f"  {r['model']:<18}{r['dma_queues']:>7}{r['batch']:>6}"
              f"{r['from_step_s'] * 1e3:>9.3f}ms{r['tuned_step_s'] * 1e3:>9.3f}ms"
              f"{r['gain_percent']:>+7.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

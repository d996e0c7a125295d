"""How far a spec's blocking collectives are from what any algorithm could do, in the step-time
model: every collective that compute waits for (not `overlap`), priced as the spec runs it,
as the best of the all-reduce algorithms over the same rank group (each `direct` /
`two_level chip|host`, one-shot or scattered), and at the latency floor no algorithm
can beat: one copy's fixed cost from the farthest member of the group, with its bytes free.
Then the factor on the copy latencies (`ici_copy_s`, `sibling_copy_s`, `remote_issue_s`,
`collective_entry_s`, `ici_hop_s`: measured on TPU7x, the last assumed) at which the best
algorithms' total would meet a target. Modelled: the latencies are measured, these collectives' times are not.

    .venv/bin/python benchmarks/collective_floor.py                      # K3, batch 8
    .venv/bin/python benchmarks/collective_floor.py SPEC --batch 1 --target-ms 0.8
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mkc import ir, target  # noqa: E402
from mkc.compiler import check_spec  # noqa: E402
from mkc.perf import sim  # noqa: E402
from mkc.perf.constants import Rates  # noqa: E402
from mkc.perf.run import Modelled, model, perf_trace  # noqa: E402
from mkc.resolve.collectives import algorithm_stages  # noqa: E402
from mkc.steps.collectives import AllReduce, OverlapPart, Round  # noqa: E402
from mkc.trace import Collective, LayerBegin  # noqa: E402

LATENCIES = ("ici_copy_s", "sibling_copy_s", "remote_issue_s", "collective_entry_s", "ici_hop_s")


@dataclass
class Row:
    kind: str
    name: str
    line: int
    calls: int
    spec_s: float          # as the spec runs it (sends, latencies and compiled sums)
    best_s: float          # the best algorithm over the same group
    best: str
    floor_s: float         # one round and the farthest member's hops, bytes free


def blocking_collectives(s: ir.ScheduleIR, batch: int, tokens: int) -> Counter:
    """(kind, step) -> calls a step, for every collective compute waits for."""
    calls: Counter = Counter()
    kind = "prologue"
    for e in perf_trace(s, batch, tokens):
        if isinstance(e, LayerBegin):
            kind = e.tag.kind
        elif isinstance(e, Collective) and not isinstance(e.tag, OverlapPart):
            calls[kind, e.tag, e.span.line] += 1
    return calls


def group_of(stages: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    return math.prod(n for n, _ in stages), stages[0][1]


def alternatives(step, s: ir.ScheduleIR, batch: int) -> list[tuple[str, tuple[Round, ...]]]:
    """What else could reduce the same partial sums over the same ranks: (name, rounds)."""
    if not isinstance(step, AllReduce):
        return [("as written", step.rounds(batch, s.cores_per_chip))]
    a = step.entry
    topo = target.topology(s.chip, tuple(int(x) for x in s.topology.split("=")[1].split("x")))
    out = []
    for alg, stages in algorithm_stages(topo, group_of(a.stages)):
        for scatter in (None, 1):
            form = replace(step, entry=replace(a, stages=stages, scatter_from=scatter))
            padded = form.entry.chunk * stages[0][0] > a.width
            out.append((alg + (" scatter" if scatter else "") + (" (padded)" if scatter and padded
                                                                 else ""),
                        form.rounds(batch, s.cores_per_chip)))
    return out


def latency_floor(m: sim.Model, step) -> float:
    """No all-reduce or gather over a group is done before one copy from the group's farthest
    member has landed (its fixed cost and hops): every result depends on that member's share."""
    rounds = (step.rounds(m.batch, m.s.cores_per_chip) if not isinstance(step, AllReduce)
              else step.entry.stages)
    size, stride = (group_of(step.entry.stages) if isinstance(step, AllReduce)
                    else (rounds[0].size, rounds[0].stride))
    base = m.rank - (m.rank // stride % size) * stride
    x0 = m.chip_coords[m.rank]
    hops = max(sum(abs(p - q) for p, q in zip(x0, m.chip_coords[base + i * stride]))
               for i in range(size))
    r = m.rates
    if hops == 0:
        return r.sibling_copy_s
    return r.ici_copy_s + max(0, hops - 1) * r.ici_hop_s


def measure(mod: Modelled, calls: Counter, rates: Rates | None = None) -> list[Row]:
    """The rows of every blocking collective (`calls`) of the modelled step `mod`, at its
    rates or `rates`."""
    s, batch = mod.s, mod.batch
    m = sim.Model(s, batch, mod.tokens, rates or mod.rates, compiled=mod.measure)
    rows = []
    for (kind, step, line), n in calls.items():
        sums = m.compiled_collective_seconds(kind, line)
        spec = m.collective_seconds(step.rounds(batch, s.cores_per_chip), kind, line)

        def sends(rounds: tuple[Round, ...]) -> float:
            # compiled sums where the measure has them (the same for every algorithm), else
            # counted
            return sum(m.round_seconds(r, first=i == 0) + m.sums_seconds(r, kind, line)
                       for i, r in enumerate(rounds)) + sums

        best, best_s = min(((name, sends(r)) for name, r in alternatives(step, s, batch)),
                           key=lambda x: x[1])
        rows.append(Row(kind, str(step), line, n, spec, min(best_s, spec),
                        best if best_s < spec else "as written", latency_floor(m, step)))
    return rows


def latency_level_for(mod: Modelled, calls: Counter, target_s: float) -> float | None:
    """The factor on both assumed latencies at which the best algorithms' total meets
    `target_s` (None: not even with latencies free)."""
    def total(f: float) -> float:
        r = mod.rates.replace(**{k: getattr(mod.rates, k) * f for k in LATENCIES})
        return sum(x.best_s * x.calls for x in measure(mod, calls, r))

    if total(0.0) > target_s:
        return None
    lo, hi = 0.0, 1.0
    if total(hi) <= target_s:
        return 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) <= target_s else (lo, mid)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", nargs="?", default=str(ROOT / "schedules" / "kimi_k3.sched"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--target-ms", type=float, default=0.8)
    args = ap.parse_args()
    s = check_spec(args.spec).ir
    mod = model(s, args.batch)
    calls = blocking_collectives(s, args.batch, mod.tokens)
    rows, modelled = measure(mod, calls), mod.res.by_cause["collectives"]
    print(f"{Path(args.spec).name}, batch {args.batch}: blocking collectives (modelled, us a call)")
    print(f"  {'kind':6} {'collective':34} {'line':>4} {'calls':>5} {'spec':>6} {'best':>6} "
          f"{'floor':>6}  best algorithm")
    for r in sorted(rows, key=lambda r: -r.spec_s * r.calls):
        print(f"  {r.kind:6} {r.name:34} {r.line:4d} {r.calls:5d} {r.spec_s * 1e6:6.2f} "
              f"{r.best_s * 1e6:6.2f} {r.floor_s * 1e6:6.2f}  {r.best}")
    tot = {k: sum(getattr(r, k) * r.calls for r in rows) * 1e3 for k in ("spec_s", "best_s", "floor_s")}
    print(f"step total (ms): as written {tot['spec_s']:.3f}, best algorithms {tot['best_s']:.3f}, "
          f"latency floor {tot['floor_s']:.3f}; the model's collectives column {modelled * 1e3:.3f} "
          "(with overlapped collectives' waits)")
    f = latency_level_for(mod, calls, args.target_ms / 1e3)
    lat = ", ".join(f"{k} {getattr(mod.rates, k) * 1e6:.3f} us" for k in LATENCIES)
    verdict = (f"the best algorithms meet {args.target_ms} ms as measured" if f == 1.0 else
               f"the best algorithms meet {args.target_ms} ms at {f:.2f} x these" if f is not None
               else f"no latency level meets {args.target_ms} ms")
    print(f"latencies ({lat}; mkc/perf/data/{s.chip}.json): {verdict}")


if __name__ == "__main__":
    main()

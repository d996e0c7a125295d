"""The campaign's command line (`python -m fuzz`, or benchmarks/fuzz_campaign.py): see `fuzz`."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import fuzz
from fuzz.cases import FAILURE_CLASSES, ROOT
from fuzz.pool import run_campaign
from fuzz.report import print_report, summarize
from fuzz.targets import TARGETS, available_targets, make_case, reproducer, unavailable
from fuzz.worker import worker_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        work, mem, timeout, frac, pre = argv[1:6]
        worker_main(work, int(mem), float(timeout), float(frac), pre == "1")
        return 0
    ap = argparse.ArgumentParser(description=fuzz.__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10.0,
                    help="CPU seconds per case (wall-clock cap: 3x, at least 30 s)")
    ap.add_argument("--mem-gib", type=float, default=4.0, help="address-space cap per worker")
    ap.add_argument("--compile-fraction", type=float, default=0.2,
                    help="share of cases also compiled, written and imported when accepted")
    ap.add_argument("--target", choices=[*TARGETS, "all"], default="check",
                    help="what runs each case (default check; all: every available target)")
    ap.add_argument("--kind", help="only this mutation kind (of the target's kinds)")
    ap.add_argument("--json", help="write the summary and every failing case here")
    ap.add_argument("--only", type=int, help="run (or --emit) only case I")
    ap.add_argument("--emit", help="with --only: write the case's spec and files to this directory")
    args = ap.parse_args(argv)
    if args.target == "all":
        missing = [n for n in TARGETS if n not in available_targets()]
        if missing:
            print(f"--target all skips {', '.join(missing)}: {unavailable(missing[0])}", flush=True)
    elif why := unavailable(args.target):
        ap.error(f"--target {args.target}: {why}")
    if args.kind is not None:
        known = sorted({k for n in available_targets() for k in TARGETS[n].kinds()}
                       if args.target == "all" else TARGETS[args.target].kinds())
        if args.kind not in known:
            ap.error(f"--kind {args.kind}: not a kind of --target {args.target}; its kinds: "
                     f"{', '.join(known)}")
    if args.emit is not None:
        case = make_case(args.seed, args.only, args.compile_fraction, args.kind, args.target)
        d = Path(args.emit)
        d.mkdir(parents=True, exist_ok=True)
        spec = case.materialize(d)
        print(reproducer(case))
        print(f"wrote {spec}")
        return 0
    indices = [args.only] if args.only is not None else list(range(args.cases))
    sys.path.insert(0, str(ROOT))        # this checkout's mkc, as the workers import it

    def stop(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, stop)   # also when started in the background (SIGINT ignored)
    signal.signal(signal.SIGTERM, stop)  # kill PID: stop and report the cases done so far
    t0 = time.perf_counter()
    results = run_campaign(args.seed, indices, args.workers, args.timeout, args.mem_gib,
                           args.compile_fraction, args.kind, progress=True, target=args.target)
    wall = time.perf_counter() - t0
    summary = summarize(results, args.seed, args.compile_fraction, args.kind, args.target)
    print_report(summary, results, args, wall)
    if args.json:
        sigs = {k: {"count": s["count"], "kinds": s["kinds"], "bases": s["bases"],
                    "case": s["best"][1], "detail": s["best"][2], "reproducer": s["best"][3]}
                for k, s in summary["signatures"].items()}
        Path(args.json).write_text(json.dumps({
            "cases": len(results), "seed": args.seed, "wall_seconds": round(wall, 2),
            "target": args.target, "by_class": summary["by_class"],
            "by_target": summary["by_target"], "by_kind": summary["by_kind"],
            "by_base": summary["by_base"], "signatures": sigs,
            "failures": [r for r in results if r["cls"] in FAILURE_CLASSES]}, indent=2))
    return 1 if any(summary["by_class"][c] for c in FAILURE_CLASSES) else 0


if __name__ == "__main__":
    sys.exit(main())

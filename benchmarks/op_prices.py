"""Op-level compiled prices (`mkc.perf.op_measures`) against whole-kernel compiled prices
(`mkc.perf.bundles`) on candidates around Kimi K3: does pricing each op body by its own measure
rank the candidates as compiling each whole kernel does, and how long does it take?

    .venv/bin/python benchmarks/op_prices.py            # the comparison (whole kernels cached)
    .venv/bin/python benchmarks/op_prices.py --whole    # compile the missing whole kernels too
                                                        # (one at a time, ~1 min each here)
    .venv/bin/python benchmarks/op_prices.py --ship     # derive the shipped op measures

`--ship` writes `mkc/perf/data/ops/<chip>.json`: every op row of every shipped whole-kernel
measure (`mkc/perf/data/bundles`) whose key matches the shipped spec's module today, under the
op's key; then each op of a shipped kernel (decode at the batch range's ends, verify) that no
row gave (libtpu merged it into a neighbour) compiled alone, and every op of Kimi K3 at each
batch of its range (`SHIP_BATCHES`), and the README walkthrough's spec with the neighbours
its `mkc tune --budget 20` tries: a few minutes.

A candidate's op-level price sees only what mkc ships (a private op cache takes the ops compiled
alone, no user whole-kernel measure), so each run times what a fresh user waits for; the
whole-kernel price is `mkc perf --compiled`'s (kept in the user's cache). Times are modelled
steps, not measurements.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

K3 = ROOT / "schedules" / "kimi_k3.sched"
# Specs whose every batch of their range ships op measures (the rest: the range's ends).
SHIP_BATCHES = ("kimi_k3",)
HEADROOM = "  expect vmem headroom at least 1 MiB\n"


def _variant(text: str, *edits: tuple[str, str]) -> str:
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text


def candidates() -> list[tuple[str, str, int]]:
    """(label, spec text, batch): K3 and neighbours a tuner tries. Ring changes drop the
    headroom expectation (a deeper ring leaves under 1 MiB: priced, not shipped)."""
    k3 = K3.read_text()
    ring = "ring weights: 8 slots of bf16 tiles up to 1024 x 896"
    ahead = "stream weights ahead 8 {"
    free = k3.replace(HEADROOM, "")
    return [
        ("K3 as shipped", k3, 8),
        ("ring slots +1", _variant(free, (ring, ring.replace("8 slots", "9 slots")),
                                   (ahead, "stream weights ahead 9 {")), 8),
        ("ring slots -1", _variant(k3, (ring, ring.replace("8 slots", "7 slots")),
                                   (ahead, "stream weights ahead 7 {")), 8),
        ("ring tile 1024 x 768", _variant(free, (ring, ring.replace("x 896", "x 768"))), 8),
        ("expert slots 2", _variant(k3, ("view experts: 3 slots", "view experts: 2 slots")), 8),
        ("expert slots 4", _variant(free, ("view experts: 3 slots", "view experts: 4 slots")), 8),
        ("K3 at batch 3", k3, 3),
        ("K3 at batch 1", k3, 1),
    ]


def _spec(text: str):
    from mkc.checks import run_checks
    from mkc.lang.parser import parse
    from mkc.resolve import resolve
    s = resolve(parse(text, str(K3)), None)
    run_checks(s)
    return s


def ship() -> None:
    from mkc.lang.parser import parse_file
    from mkc.perf import bundles, op_measures
    from mkc.resolve import resolve
    import json
    by_chip: dict[str, list[dict]] = {}
    for path in sorted((ROOT / "schedules").glob("*.sched")):
        s = resolve(parse_file(path)[0], None)
        try:
            measures = json.loads((bundles.DATA / f"{s.name}.json").read_text())["measures"]
        except OSError:
            continue
        got = []
        # a decode kernel's op rows are kept over a verify kernel's of the same body (saved last)
        for m in sorted(measures, key=lambda m: m["kernel"] == "decode"):
            if m.get("schema") == bundles.SCHEMA and (m["kernel"] == "decode" or s.verify_rows):
                got += op_measures.derive(s, m)
        print(f"{path.name}: {len(got)} op measures from {len(measures)} whole-kernel measures")
        by_chip.setdefault(s.chip, []).extend(got)
    for chip, entries in by_chip.items():
        if entries:
            path = op_measures.save(entries, chip, op_measures.DATA)
            print(f"wrote {len(entries)} to {path.relative_to(ROOT)}")
    for path in sorted((ROOT / "schedules").glob("*.sched")):
        s = resolve(parse_file(path)[0], None)
        batches = (range(s.batch_min, s.batch_max + 1) if s.name in SHIP_BATCHES
                   else sorted({s.batch_min, s.batch_max}))
        kernels = [(b, None) for b in batches]
        if s.verify_rows:
            kernels.append((s.verify_sequences[0] * s.verify_rows, s.verify_rows))
        for rows, vr in kernels:
            bodies = op_measures.op_bodies(s, rows, vr)
            have = op_measures.load(s.chip, (op_measures.DATA,))
            want = [k for k, b in bodies.items() if b.key.id not in have]
            if not want:
                continue
            t0 = time.perf_counter()
            got, failed = op_measures.compile_ops(s, rows, vr, bodies, want,
                                                  directory=op_measures.DATA)
            print(f"{path.name} at {rows} rows{' (verify)' if vr else ''}: {len(got)} ops "
                  f"compiled alone in {time.perf_counter() - t0:.0f} s"
                  + (f", failed: {failed}" if failed else ""), flush=True)


def ship_walkthrough() -> None:
    """The README walkthrough's spec (MINI Qwen) priced at its batches and tuned as the README
    does, every op compiled alone into the shipped store: the walkthrough prints compiled
    prices without a compile."""
    import re

    from mkc.perf import op_measures, tune
    text = re.search(r"```sched\n(# MINI Qwen.*?)```", (ROOT / "README.md").read_text(),
                     re.S).group(1)
    saved = os.environ.get("MKC_OP_CACHE")
    os.environ["MKC_OP_CACHE"] = str(op_measures.DATA)
    try:
        t0 = time.perf_counter()
        tune.tune(text, "my_qwen.sched", None, budget=20)
        print(f"README walkthrough: its tune's candidates priced in "
              f"{time.perf_counter() - t0:.0f} s, their ops kept", flush=True)
    finally:
        if saved is None:
            os.environ.pop("MKC_OP_CACHE")
        else:
            os.environ["MKC_OP_CACHE"] = saved


def compare(whole: bool) -> None:
    import importlib

    from mkc.perf import bundles
    run = importlib.import_module("mkc.perf.run")   # the package exports a function `run`
    rows = []
    real = bundles.user_cache()            # whole-kernel measures compiled here: compared with
    with tempfile.TemporaryDirectory(prefix="mkc-op-cache-") as cache:
        os.environ["MKC_OP_CACHE"] = cache
        # the per-op price sees only what mkc ships, as a fresh user's would
        os.environ["MKC_BUNDLE_CACHE"] = str(Path(cache) / "bundles")
        for label, text, batch in candidates():
            s = _spec(text)
            t0 = time.perf_counter()
            m, why = run.op_measure(s, batch)
            op_step = run.step_model(s, batch, s.context, compiled=m, keep_timeline=False).step_s
            op_s = time.perf_counter() - t0
            counted = run.step_model(s, batch, s.context, keep_timeline=False).step_s
            w = bundles.cached(s, "decode", batch, places=(bundles.DATA, real))
            if w is None and whole:
                t1 = time.perf_counter()
                w = bundles.measure(s, "decode", batch)
                bundles.save(w, real)
                print(f"  compiled the whole kernel of {label} in {time.perf_counter() - t1:.0f} s")
            whole_step = (run.step_model(s, batch, s.context, compiled=w, keep_timeline=False).step_s
                          if w else None)
            info = m["op_level"] if m else {}
            rows.append((label, batch, op_step, op_s, whole_step, counted, info))
            print(f"{label:<22} B{batch}: per op {op_step * 1e3:7.3f} ms in {op_s:5.1f} s "
                  f"({info.get('ops_derived', 0)} derived, {info.get('ops_compiled_alone', 0)} "
                  f"compiled alone, {info.get('ops_compiled_now', 0)} of them now, "
                  f"{len(info.get('ops_counted', {}))} counted); whole kernel "
                  + (f"{whole_step * 1e3:7.3f} ms" if whole_step else "   (none)")
                  + f"; counted {counted * 1e3:7.3f} ms" + ("" if m else f"  [{why}]"), flush=True)
    for b in sorted({r[1] for r in rows}):
        same = [r for r in rows if r[1] == b and r[4] is not None]
        if len(same) < 2:
            continue
        by_op = [r[0] for r in sorted(same, key=lambda r: r[2])]
        by_whole = [r[0] for r in sorted(same, key=lambda r: r[4])]
        by_count = [r[0] for r in sorted(same, key=lambda r: r[5])]
        pairs = [(x, y) for i, x in enumerate(same) for y in same[i + 1:]]
        agree = sum(_order(x[2], y[2]) == _order(x[4], y[4]) for x, y in pairs)
        agree_c = sum(_order(x[5], y[5]) == _order(x[4], y[4]) for x, y in pairs)
        err = max(abs(r[2] / r[4] - 1) for r in same)
        print(f"batch {b}: whole-kernel order {by_whole}\n  per-op order {by_op}: "
              f"{agree}/{len(pairs)} pairs agree, worst step {100 * err:.1f}% off the "
              f"whole-kernel price\n  counted order {by_count}: {agree_c}/{len(pairs)} agree")


def _order(a: float, b: float) -> int:
    """-1, 0 or 1: which step is shorter, equal within 0.05 % (a tie, as two candidates whose
    kernels differ in nothing that is priced)."""
    return 0 if abs(a - b) <= 5e-4 * max(a, b) else (1 if a > b else -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ship", action="store_true")
    ap.add_argument("--whole", action="store_true")
    a = ap.parse_args()
    if a.ship:
        ship()
        ship_walkthrough()
    else:
        compare(a.whole)


if __name__ == "__main__":
    main()

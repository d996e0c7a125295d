"""Compile every shipped spec's kernels with libtpu (compile-only) and keep what its final LLO
says per op (`mkc.perf.bundles`) in `mkc/perf/data/bundles/<spec>.json`, so that `mkc perf
--bundles` on a shipped spec needs no compile. Each spec: decode at batch 1 and at its largest
batch, and its verify step if it has one. An entry is used only while the module, the code it
runs and libtpu's version are those it was measured with; `--check` lists the stale ones.

    .venv/bin/python benchmarks/bundles.py                  # every spec (K3 ~2 min a kernel)
    .venv/bin/python benchmarks/bundles.py --only qwen3_8   # specs whose name has it
    .venv/bin/python benchmarks/bundles.py --check          # which entries are stale; no compile
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
COMMAND = ".venv/bin/python benchmarks/bundles.py"


def kernels(s) -> list[tuple[str, int]]:
    out = [("decode", b) for b in sorted({1, s.batch_max})]
    if s.verify_rows:
        out.append(("verify", s.verify_sequences[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    from mkc import compiler
    from mkc.perf import bundles
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="specs whose name contains this")
    ap.add_argument("--check", action="store_true", help="list stale or missing entries")
    args = ap.parse_args(argv)
    stale = 0
    for spec in sorted((ROOT / "schedules").glob("*.sched")):
        if args.only not in spec.stem:
            continue
        s = compiler.check_spec(str(spec)).ir
        for kernel, batch in kernels(s):
            have = bundles.cached(s, kernel, batch)
            if args.check or have is not None:
                stale += have is None
                print(f"{spec.stem} {kernel} {batch}: {'fresh' if have else 'stale or missing'}")
                continue
            t0 = time.perf_counter()
            entry = bundles.measure(s, kernel, batch)
            bundles.save(entry, bundles.DATA)
            top = max(entry["rows"], key=lambda r: bundles.per_step(entry, r))
            print(f"{spec.stem} {kernel} {batch}: {entry['bundles']} bundles, costliest row "
                  f"{top['key']} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every shipped spec retargeted (`mkc retarget`) to every slice of the topology table: the
verdict and the modelled step of the spec written, as a Markdown table (see docs/targets.md).
Times are modelled (`mkc.perf`), not measured.

    .venv/bin/python benchmarks/retarget_table.py [--out benchmarks/data/retarget_table.jsonl]
        [--specs schedules/kimi_k3.sched ...] [--gens tpu7x v6e] [--max-chips 64] [--markdown]

Each result is appended to the JSONL file as it is found, and a (spec, slice) already there is
not run again, so the sweep resumes where it stopped. --markdown prints the table from the
file.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mkc import target  # noqa: E402
from mkc.diagnostics import MkcError  # noqa: E402
from mkc.lang.fmt import format_text  # noqa: E402
from mkc.retarget import Checked, retarget  # noqa: E402
from mkc.retarget.fit import check  # noqa: E402


def slices(gens: list[str], max_chips: int) -> list[str]:
    return [f"{g} topology {s}" for g in gens for s in target.standard_shapes(g)
            if math.prod(int(d) for d in s.split("x")) <= max_chips]


def run(spec: Path, slice_text: str, before: Checked) -> dict:
    t0 = time.perf_counter()
    row = {"spec": spec.stem, "slice": slice_text}
    try:
        res = retarget(spec.read_text(), str(spec.relative_to(ROOT)), slice_text, before=before,
                       name_nearest=False)
    except MkcError as e:
        d = e.diagnostics[0]
        row |= {"verdict": d.code, "why": d.message}
    else:
        row |= {"verdict": "ok", "ranks": res.after.ir.ranks, "candidate": res.label,
                "step_ms": {str(b): t * 1e3 for b, t in res.after.steps.items()},
                "notes": res.after.notes}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def sweep(specs: list[Path], gens: list[str], max_chips: int, out: Path) -> None:
    done = set()
    if out.exists():
        done = {(r["spec"], r["slice"]) for r in map(json.loads, out.read_text().splitlines())}
    for spec in specs:
        todo = [s for s in slices(gens, max_chips) if (spec.stem, s) not in done]
        if not todo:
            continue
        text = format_text(spec.read_text())
        before = Checked(text, *check(text, str(spec), None))
        before.model()
        for i, slice_text in enumerate(todo):
            print(f"\r{spec.stem}: {i + 1}/{len(todo)} {slice_text:<28}", end="", file=sys.stderr,
                  flush=True)
            row = run(spec, slice_text, before)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        print(file=sys.stderr)


def markdown(out: Path, specs: list[Path]) -> str:
    """One row per slice, one column per spec: B1 / B8 modelled ms, or why not."""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cell = {(r["spec"], r["slice"]): r for r in rows}
    names = [s.stem for s in specs]
    lines = ["| slice | ranks | " + " | ".join(f"`{n}`" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for sl in dict.fromkeys(r["slice"] for r in rows):
        gen, _, shape = sl.split()
        ranks = target.topology(gen, tuple(int(d) for d in shape.split("x"))).num_cores
        cells = []
        for n in names:
            r = cell.get((n, sl))
            cells.append("" if r is None else _cell(r))
        if any(c and not c.startswith("HBM") for c in cells):
            lines.append(f"| {gen} {shape} | {ranks} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(r: dict) -> str:
    if r["verdict"] == "ok":
        ms = r["step_ms"]
        text = " / ".join(f"{ms[b]:.2f}" for b in sorted(ms, key=int))
        serves_less = any("batch" in n or "verify" in n for n in r["notes"])
        return text + ("*" if serves_less else "")
    why = r["why"]
    if "HBM short" in why:
        return "HBM"
    if "no shard rules" in why:
        return "rules"
    return "VMEM" if "VMEM" in why else r["verdict"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/data/retarget_table.jsonl")
    ap.add_argument("--specs", nargs="*", type=Path,
                    default=sorted((ROOT / "schedules").glob("*.sched")))
    ap.add_argument("--gens", nargs="*", default=target.known_chips())
    ap.add_argument("--max-chips", type=int, default=64,
                    help="the largest slices swept (default 64 chips)")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    specs = [s.resolve() for s in args.specs]
    if args.markdown:
        print(markdown(args.out, specs))
    else:
        sweep(specs, args.gens, args.max_chips, args.out)


if __name__ == "__main__":
    main()

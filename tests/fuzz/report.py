"""The campaign's report: outcomes by class, target, kind and base, and each failure signature
with its smallest reproducer."""
from __future__ import annotations


from fuzz.cases import BASE_WEIGHTS, CLASSES, FAILURE_CLASSES
from fuzz.targets import TARGETS, make_case, reproducer


def summarize(results: list[dict], seed: int, compile_fraction: float, kind: str | None = None,
              target: str = "check") -> dict:
    by_class = {c: 0 for c in CLASSES}
    by_target: dict[str, dict[str, int]] = {}
    by_kind: dict[str, dict[str, int]] = {}      # "kind" for check's cases, else "target/kind"
    by_base: dict[str, dict[str, int]] = {}
    sigs: dict[str, dict] = {}
    for r in results:
        by_class[r["cls"]] += 1
        kind_key = r["kind"] if r["target"] == "check" else f"{r['target']}/{r['kind']}"
        for table, key in ((by_target, r["target"]), (by_kind, kind_key), (by_base, r["base"])):
            table.setdefault(key, {c: 0 for c in CLASSES})[r["cls"]] += 1
        if r["cls"] in FAILURE_CLASSES:
            key = f"{r['cls']}: {r['sig']}"
            case = make_case(seed, r["index"], compile_fraction, r.get("forced_kind", kind),
                             r.get("forced_target", target))
            size = (len(reproducer(case)), len(case.spec))
            s = sigs.setdefault(key, {"count": 0, "kinds": {}, "bases": {}, "best": None})
            s["count"] += 1
            s["kinds"][r["kind"]] = s["kinds"].get(r["kind"], 0) + 1
            s["bases"][r["base"]] = s["bases"].get(r["base"], 0) + 1
            if s["best"] is None or size < s["best"][0]:
                s["best"] = (size, r["index"], r.get("detail", ""), reproducer(case))
    slow = sorted((r for r in results if r.get("seconds") and r["cls"] != "hang"),
                  key=lambda r: -r["seconds"])[:5]
    return {"by_class": by_class, "by_target": by_target, "by_kind": by_kind, "by_base": by_base,
            "signatures": sigs, "slowest": slow}


def _row_order(title: str, key: str) -> tuple:
    """Report rows in the registries' order: targets, their kinds, bases."""
    names = list(TARGETS)
    if title == "target":
        return (names.index(key),)
    if title == "base":
        return (list(BASE_WEIGHTS).index(key),)
    target, _, kind = key.rpartition("/")
    kinds = list(TARGETS[target or "check"].kinds())
    return (names.index(target or "check"), kinds.index(kind) if kind in kinds else len(kinds), kind)


def print_report(summary: dict, results: list[dict], args, wall: float) -> None:
    n = len(results)
    print(f"\nmkc fuzz campaign: {n} cases, seed {args.seed}, {args.workers} workers, "
          f"timeout {args.timeout} s, memory cap {args.mem_gib} GiB")
    print(f"wall time {wall:.1f} s, {n / wall:.1f} cases/s")
    print("\noutcomes: " + ", ".join(f"{c} {v}" for c, v in summary["by_class"].items()))
    cols = [c for c in CLASSES if summary["by_class"][c]]
    for title, table in (("target", "by_target"), ("kind", "by_kind"), ("base", "by_base")):
        width = max([17] + [len(k) + 2 for k in summary[table]])
        print(f"\n{title:<{width}}" + "".join(f"{c:>15}" for c in cols))
        for key, row in sorted(summary[table].items(), key=lambda kv: _row_order(title, kv[0])):
            print(f"{key:<{width}}" + "".join(f"{row[c]:>15}" for c in cols))
    sigs = summary["signatures"]
    print(f"\n{len(sigs)} distinct failure signatures")
    for key, s in sorted(sigs.items(), key=lambda kv: -kv[1]["count"]):
        _, idx, detail, repro = s["best"]
        print(f"\n== {key}\n   {s['count']} cases; kinds {s['kinds']}; bases {s['bases']}")
        if detail:
            print("   " + detail.replace("\n", "\n   ")[:900])
        print("   reproducer (case %d):\n     " % idx + repro.replace("\n", "\n     "))
    if summary["slowest"]:
        print("\nslowest non-hanging cases: " + ", ".join(
            f"#{r['index']} {r['kind']} {r['seconds']:.2f} s" for r in summary["slowest"]))
    print(f"\nreproduce: .venv/bin/python benchmarks/fuzz_campaign.py --cases {args.cases} "
          f"--seed {args.seed} --workers {args.workers} --timeout {args.timeout} "
          f"--compile-fraction {args.compile_fraction} --target {args.target}")


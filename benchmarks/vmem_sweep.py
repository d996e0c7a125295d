"""Sweep mkc's VMEM verdict against libtpu's, near the boundary, for both shipped specs.

Each variant edits a shipped spec (ring slots, tile bounds, KV tiles, batch 1/8/16, vmem limit
and reserve), renders its module and compiles the kernel at the spec's largest batch with
libtpu compile-only for the spec's topology, in a fresh subprocess with a timeout
(mkc.confirm.run_compile). libtpu's verdict, its exact VMEM use when it fits (from XLA's
buffer assignment) and its "Used X of Y" and largest allocations when it does not are kept
as data in benchmarks/data/vmem_sweep.json. The report recomputes mkc's verdict for every
variant with the current capacity model, so a model change is judged against the same data
without compiling again; "before" is the model this sweep was built to replace (rows padded
to 16 for bf16 and 8 for f32 whatever their height, budget = limit - reserve).

    .venv/bin/python benchmarks/vmem_sweep.py                # compile every variant (~35-40 min)
    .venv/bin/python benchmarks/vmem_sweep.py --missing      # only variants not in the data yet
    .venv/bin/python benchmarks/vmem_sweep.py --only qwen    # one model's variants
    .venv/bin/python benchmarks/vmem_sweep.py --report       # table + agreement from the data
    .venv/bin/python benchmarks/vmem_sweep.py --fit          # the compiler-scratch table
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
DATA = ROOT / "benchmarks" / "data" / "vmem_sweep.json"
# The layouts the sweep was measured on (the shipped specs before they took the tuner's
# geometry; the recorded libtpu verdicts belong to these).
SPECS = {"qwen": ROOT / "benchmarks" / "data" / "untuned" / "qwen3_8_27b.sched",
         "k3": ROOT / "benchmarks" / "data" / "untuned" / "kimi_k3.sched"}
COMMAND = ".venv/bin/python benchmarks/vmem_sweep.py"
MIB = 2**20
SHIPPED_RING = {"qwen": (12, "1024 x 1280"), "k3": (4, "1024 x 1024")}   # slots, tile bound


def _variant(model: str, batch: int, slots: int, *, tile: str | None = None,
             kv: str | None = None, limit: str = "64 MiB", reserve: str = "0 MiB",
             experts: int | None = None) -> dict:
    """A variant as text edits of the shipped spec."""
    ring_slots, ring_tile = SHIPPED_RING[model]
    subs = [["batch   1 to 8", f"batch   1 to {batch}" if batch > 1 else "batch   1"],
            ["limit 64 MiB reserve 6 MiB", f"limit {limit} reserve {reserve}"],
            [f"ring weights: {ring_slots} slots of bf16 tiles up to {ring_tile}",
             f"ring weights: {slots} slots of bf16 tiles up to {tile or ring_tile}"],
            [f"stream weights ahead {ring_slots}",
             f"stream weights ahead {min(ring_slots, slots)}"]]
    if kv:
        subs.append(["kv tiles 2 slots of 128 tokens ahead 1", f"kv tiles {kv}"])
    if experts:
        subs.append(["view experts: 6 slots of expert", f"view experts: {experts} slots of expert"])
    name = f"{model} B{batch} ring {slots}" + (f" tile {tile}" if tile else "") + (
        f" kv {kv}" if kv else "") + (f" experts {experts}" if experts else "") + (
        f" limit {limit}" if limit != "64 MiB" else "") + (
        f" reserve {reserve}" if reserve != "0 MiB" else "")
    return {"name": name, "model": model, "batch": batch, "subs": subs}


def variants() -> list[dict]:
    v = []
    q = "qwen"
    # Ring depth around the boundary at each batch (bf16 1024 x 1280 slots, 2.5 MiB each).
    for s in (22, 23, 24, 25, 26):
        v.append(_variant(q, 1, s))
    for s in (18, 19, 20, 21, 22):
        v.append(_variant(q, 8, s))
    for s in (13, 14, 15, 16, 17):
        v.append(_variant(q, 16, s))
    # Other tile bounds: the slot shape changes, and with it stage, acc and logits.
    for b, slots in ((16, (17, 18, 19, 20)), (8, (23, 24, 25, 26))):
        for s in slots:
            v.append(_variant(q, b, s, tile="1024 x 1024"))
    for b, slots in ((16, (12, 13, 14, 15, 16)), (8, (16, 17, 18, 19, 20))):
        for s in slots:
            v.append(_variant(q, b, s, tile="1024 x 1536"))
    for s in (20, 21, 22, 24, 25, 26):
        v.append(_variant(q, 16, s, tile="768 x 1024"))
    # KV tiles: the attention's scoped buffers grow with slots x tokens x batch.
    for b, kv, slots in ((16, "4 slots of 256 tokens ahead 2", (9, 10, 11)),
                         (8, "4 slots of 512 tokens ahead 2", (13, 14, 15, 16)),
                         (16, "3 slots of 128 tokens ahead 2", (14, 15)),
                         (8, "2 slots of 256 tokens ahead 1", (18, 19, 20)),
                         (1, "4 slots of 512 tokens ahead 2", (22, 23))):
        for s in slots:
            v.append(_variant(q, b, s, kv=kv))
    # The spec's limit below the chip's, and a reserve (user headroom).
    for b, slots in ((8, (13, 14, 15)), (16, (9, 10))):
        for s in slots:
            v.append(_variant(q, b, s, limit="48 MiB"))
    for s in (11, 12):
        v.append(_variant(q, 16, s, limit="56 MiB"))
    # Where do spill slots go when the limit is under the chip's usable VMEM? B16 ring 15
    # needs 59.9 MiB of buffers and 1.9 MiB of spill slots.
    for limit in ("61 MiB", "63 MiB", "60 MiB"):
        v.append(_variant(q, 16, 15, limit=limit))
    for s in (19, 20):
        v.append(_variant(q, 8, s, reserve="1 MiB"))
    for s in (15,):
        v.append(_variant(q, 16, s, reserve="2 MiB"))
    k = "k3"
    # K3: ring slots of bf16 1024 x 1024 (2 MiB each) beside a 30.5 MiB pool.
    for b, slots in ((1, (14, 15)), (8, (8, 9, 10)), (16, (2, 3, 4))):
        for s in slots:
            v.append(_variant(k, b, s))
    v.append(_variant(k, 8, 7, experts=7))
    v.append(_variant(k, 8, 8, experts=7))
    v.append(_variant(k, 8, 7, kv="4 slots of 128 tokens ahead 2"))
    v.append(_variant(k, 8, 6, limit="60 MiB"))
    v.append(_variant(k, 8, 7, limit="60 MiB"))
    return v


def _spec_text(var: dict) -> str:
    # The sweep measures decode kernels at each variant's batch: a verify step (whose sequences
    # must lie in the batch range) is not part of them.
    text = re.sub(r"^ *verify .*\n", "", SPECS[var["model"]].read_text(), flags=re.M)
    for old, new in var["subs"]:
        if old not in text:
            raise ValueError(f"{var['name']}: '{old}' is not in {SPECS[var['model']].name}")
        text = text.replace(old, new)
    return text


# ---- mkc's side ---------------------------------------------------------------------------
def _legacy_bytes(shape, dtype) -> int:
    """The model before this sweep: rows padded to 16 (bf16), 8 (32-bit), 32 (8-bit)."""
    from mkc import ir
    tile = {"f32": 8, "int32": 8, "u32": 8, "bf16": 16, "int8": 32, "u8": 32}[dtype]
    dims = list(shape) or [1]
    if len(dims) == 1:
        dims = [1] + dims
    dims[-1] = -(-dims[-1] // 128) * 128
    dims[-2] = -(-dims[-2] // tile) * tile
    n = ir.DTYPE_BYTES[dtype]
    for d in dims:
        n *= d
    return n


def mkc_verdicts(var: dict) -> dict:
    """mkc's view of a variant with the current model, and with the model it replaces."""
    from mkc import ir
    from mkc.checks import capacity
    from mkc.diagnostics import MkcError
    from mkc.lang.parser import parse_file
    from mkc.resolve import resolve
    from mkc.trace import build_trace

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / SPECS[var["model"]].name
        path.write_text(_spec_text(var))
        try:
            s = resolve(parse_file(path)[0], None)
        except MkcError as e:
            return {"error": e.diagnostics[0].code + ": " + e.diagnostics[0].message}
    events = build_trace(s)
    b = var["batch"]
    peak, where, live = capacity.vmem_budget(s, events, b)
    budget = capacity.vmem_budget_bytes(s, b)
    # Before: the same trace and live set, padded the old way, against limit - reserve.
    buffers = [x.at_batch(b) for x in s.buffers]
    old_live: dict[str, int] = {}
    base = sum(_legacy_bytes(x.shape, x.dtype) for x in buffers if x.scope is None)
    old_peak = base
    by_name = {x.name: x for x in buffers}
    for e in events:
        if e.op == "alloc":
            x = by_name[e.buffer]
            old_live[e.buffer] = _legacy_bytes(x.shape, x.dtype)
            old_peak = max(old_peak, base + sum(old_live.values()))
        elif e.op == "free":
            old_live.pop(e.buffer, None)
    tokens = max((k.kv.tokens for k in s.kinds.values() if k.kv), default=0)
    return {"family": s.family, "kv_tokens": tokens, "usable": capacity.usable_vmem_bytes(s),
            "peak": peak, "budget": budget, "fits": peak <= budget,
            "where": where,
            "overhead": capacity.compiler_overhead_bytes(s, b),
            "buffers": peak - capacity.compiler_overhead_bytes(s, b)
            - capacity.vmem_window_bytes(s, b),
            "old_peak": old_peak, "old_budget": s.vmem_limit - s.vmem_reserve,
            "old_fits": old_peak <= s.vmem_limit - s.vmem_reserve,
            "limit": s.vmem_limit, "reserve": s.vmem_reserve,
            "scratch": sum(x.vmem_bytes for x in buffers if x.scope is None and x.cls != "output"),
            "padding": {"tile_rows_bf16": ir.tile_rows(b, "bf16")}}


# ---- libtpu's side ------------------------------------------------------------------------
def compile_variant(var: dict, timeout: float) -> dict:
    from mkc.codegen.emit import render
    from mkc.confirm import run_compile
    from mkc.lang.parser import parse_file
    from mkc.resolve import resolve

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / SPECS[var["model"]].name
        text = _spec_text(var)
        path.write_text(text)
        s = resolve(parse_file(path)[0], None)
        module = Path(tmp) / f"{s.name}.py"
        module.write_text(render(s, text))
        r = run_compile(module, var["batch"], timeout)
    r["seconds"] = round(r.get("seconds", 0.0), 1)
    return r


# ---- the report ---------------------------------------------------------------------------
def _classify(fits: bool, libtpu: str) -> str:
    if libtpu not in ("fits", "out_of_vmem"):
        return "n/a"
    if fits and libtpu == "fits":
        return "agree"
    if not fits and libtpu == "out_of_vmem":
        return "agree"
    return "FALSE FIT" if fits else "false overflow"


def report(results: list[dict]) -> str:
    lines = [f"{'variant':<58} {'libtpu':>12} {'used':>7} {'mkc':>7} {'budget':>7} "
             f"{'now':>14} {'before':>14}"]
    stats = {"now": {}, "before": {}}
    largest = {m: max(r["var"]["batch"] for r in results if r["var"]["model"] == m)
               for m in {r["var"]["model"] for r in results}}
    for r in results:
        var, tpu = r["var"], r["libtpu"]
        m = mkc_verdicts(var)
        if "error" in m:
            lines.append(f"{var['name']:<58} mkc error: {m['error']}")
            continue
        now = _classify(m["fits"], tpu["libtpu"])
        before = _classify(m["old_fits"], tpu["libtpu"])
        big = var["batch"] == largest[var["model"]]
        for key, verdict in (("now", now), ("before", before)):
            if verdict == "n/a":
                continue
            for scope in ("all", "largest batch") if big else ("all",):
                st = stats[key].setdefault(scope, {"n": 0, "agree": 0, "FALSE FIT": 0,
                                                   "false overflow": 0})
                st["n"] += 1
                st[verdict] += 1
        used = tpu.get("used_bytes")
        shown = "fits" if tpu["libtpu"] == "fits" else (
            "OOM" if tpu["libtpu"] == "out_of_vmem" else tpu["libtpu"])
        lines.append(
            f"{var['name']:<58} {shown:>12} {used / MIB if used else float('nan'):7.2f} "
            f"{m['peak'] / MIB:7.2f} {m['budget'] / MIB:7.2f} {now:>14} {before:>14}")
    lines.append("")
    for key in ("before", "now"):
        for scope, st in sorted(stats[key].items()):
            lines.append(f"{key:<6} {scope:<14} agreement {st['agree']}/{st['n']} "
                         f"({100 * st['agree'] / max(1, st['n']):.1f} %): "
                         f"{st['FALSE FIT']} false fits, {st['false overflow']} false overflows")
    secs = sum(r["libtpu"].get("seconds", 0) for r in results)
    lines.append(f"{len(results)} variants, {secs / 60:.0f} min of libtpu compiles; reproduce: "
                 f"{COMMAND} (compiles; --report reads {DATA.relative_to(ROOT)})")
    return "\n".join(lines)


def fit(results: list[dict]) -> str:
    """The compiler scratch libtpu allocated beyond mkc's buffers (spill slots, internal
    scratch), per family and batch: the largest over the variants, from the exact use of those
    that fit and the program total of those over (rounded to 0.01 MiB by libtpu, so + 5 KiB),
    less the modelled KV-tile term. Only variants whose limit is the whole usable VMEM count:
    under a lower limit libtpu's kernel use leaves the spill slots out. This is the table
    capacity.COMPILER_SCRATCH holds; the per-token figures check capacity.KV_TOKEN_SCRATCH."""
    from mkc.checks import capacity
    seen: dict[str, dict[int, int]] = {}
    per_token = []
    for r in results:
        tpu = r["libtpu"]
        exact = tpu["libtpu"] == "fits" and tpu.get("used_bytes")
        program = tpu["libtpu"] == "out_of_vmem" and "Ran out of memory in memory space vmem. " \
            "Used" in tpu.get("message", "")
        if not (exact or program):
            continue
        m = mkc_verdicts(r["var"])
        if "error" in m or m["limit"] < m["usable"]:
            continue
        resid = tpu["used_bytes"] - (m["peak"] - m["overhead"]) + (0 if exact else 5243)
        extra = max(0, m["kv_tokens"] - capacity.KV_BASE_TOKENS)
        base = resid - capacity.KV_TOKEN_SCRATCH * extra
        fam = seen.setdefault(m["family"], {})
        b = r["var"]["batch"]
        if extra:
            per_token.append((r["var"]["name"], resid, extra))
        else:
            fam[b] = max(fam.get(b, 0), base)
    lines = ["COMPILER_SCRATCH = {"]
    for family, points in sorted(seen.items()):
        # an upper envelope that never falls as the batch grows
        env, top = [], 0
        for b in sorted(points):
            top = max(top, points[b])
            env.append((b, top))
        lines.append(f"    {family!r}: {env},")
    lines.append("}")
    for name, resid, extra in per_token:
        fam = next(iter(seen.values()), {})
        b = int(name.split(" B")[1].split()[0])
        if b in fam:
            lines.append(f"# {name}: {(resid - fam[b]) / extra:.0f} bytes per KV token past "
                         f"{capacity.KV_BASE_TOKENS}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", action="store_true", help="only report from the saved data")
    ap.add_argument("--fit", action="store_true",
                    help="print the compiler-scratch table the data implies")
    ap.add_argument("--only", help="variants whose name contains this")
    ap.add_argument("--missing", action="store_true", help="only variants not in the data yet")
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args()
    if a.fit:
        print(fit(json.loads(DATA.read_text())["results"]))
        return 0
    if a.report:
        data = json.loads(DATA.read_text())
        print(report(data["results"]))
        return 0
    old = {r["var"]["name"]: r for r in json.loads(DATA.read_text())["results"]} \
        if DATA.exists() else {}
    todo = [v for v in variants() if (not a.only or a.only in v["name"])
            and not (a.missing and v["name"] in old)]
    for i, var in enumerate(todo):
        r = compile_variant(var, a.timeout)
        old[var["name"]] = {"var": var, "libtpu": r}
        print(f"[{i + 1}/{len(todo)}] {var['name']}: {r['libtpu']} "
              f"{(r.get('used_bytes') or 0) / MIB:.2f} MiB in {r['seconds']} s", flush=True)
        order = {v["name"]: j for j, v in enumerate(variants())}
        results = sorted(old.values(), key=lambda r: order.get(r["var"]["name"], 1 << 30))
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(json.dumps({
            "chip": "tpu7x", "command": COMMAND, "jax": _versions(),
            "compile_seconds": round(sum(r["libtpu"].get("seconds", 0) for r in results)),
            "results": results},
            indent=1) + "\n")
    print(report(json.loads(DATA.read_text())["results"]))
    return 0


def _versions() -> dict:
    from importlib.metadata import version
    return {p: version(p) for p in ("jax", "jaxlib", "libtpu")}


if __name__ == "__main__":
    sys.exit(main())

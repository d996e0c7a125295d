"""Sweep mkc's VMEM verdict against libtpu's at the boundary, for every family and expert format.

For each swept spec (every shipped spec, K3 with FP8 and with rounded FP4 experts,
Qwen3.5-35B-A3B with rounded FP8 experts, GPT-OSS 20b and K3 with KV tiles 4x the measured
length, Llama 8B with 5 KV tiles of 512 tokens) and each kernel (the decode step at batch 1
and at the largest batch, the verify step for the most sequences, the wider kernels of `WIDER`:
batches past 8 and more sequences, and a verify step of `VERIFY_PAST` rows for one sequence
wherever the spec has one) three variants sit at mkc's own boundary, with reserve 0 and no
`expect` lines:

    peak       the spec as shipped with `vmem limit` set to mkc's own peak (rounded up to a KiB):
               mkc says it fits with nothing to spare
    ring N     the deepest weight ring mkc accepts at the chip's whole VMEM: it fits
    ring N+1   one slot deeper: mkc says it does not fit

Each variant's module is rendered and its kernel compiled with libtpu compile-only for the
spec's topology in a fresh subprocess (mkc.confirm.run_compile); libtpu's exact VMEM use when it
fits (from the compiled HLO) and its "Used X of Y" when it does not are kept in
benchmarks/data/vmem_sweep.json. The report recomputes mkc's verdict with the current model, so
a model change is judged against the same compiles: a false fit is mkc saying fits where libtpu
runs out of VMEM; the margin is mkc's peak minus libtpu's use on the points both say fit.

    .venv/bin/python benchmarks/vmem_sweep.py                 # compile every variant (~40 min)
    .venv/bin/python benchmarks/vmem_sweep.py --only gpt_oss  # variants whose name has it
    .venv/bin/python benchmarks/vmem_sweep.py --missing       # only variants not in the data yet
    .venv/bin/python benchmarks/vmem_sweep.py --report        # table and totals from the data
    .venv/bin/python benchmarks/vmem_sweep.py --list          # the variants, no compiling

`tests/test_tpu_compile.py` compiles one of these variants per family and format at each width
in CI, a different kind each day (`rotating_variant`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
DATA = ROOT / "benchmarks" / "data" / "vmem_sweep.json"
COMMAND = ".venv/bin/python benchmarks/vmem_sweep.py"
MIB = 2**20
KINDS = ("peak", "ring N", "ring N+1")

from compiler_scratch import (K3_FP4, K3_FP8, KV_256, QWEN_MOE_FP8, SCATTER_FROM, SCHEDULES,  # noqa: E402
                              compile_kernel, kernel_of, resolve_text)

# Every family and expert format: (name, spec, edits); and KV tiles 4x the measured length
# (never measured: the family's bytes a token extrapolate to them).
SWEPT = [(p.stem, p, ()) for p in sorted(SCHEDULES.glob("*.sched"))] + [
    ("kimi_k3 fp8 experts", SCHEDULES / "kimi_k3.sched", K3_FP8),
    ("kimi_k3 fp4 experts", SCHEDULES / "kimi_k3.sched", K3_FP4),
    ("qwen3_5_35b_a3b fp8 experts", SCHEDULES / "qwen3_5_35b_a3b.sched", QWEN_MOE_FP8)] + [
    (f"{name} kv 512", SCHEDULES / f"{name}.sched",
     ((KV_256[name][0], KV_256[name][1].replace("256", "512")),)) for name in ("gpt_oss_20b", "kimi_k3")] + [
    # Llama 8B's KV tiles as an outside sweep edited them: its decode step at batch 8 is the
    # larger kernel (libtpu: 64.37 MiB as shipped otherwise), beside a 16-row verify step
    ("llama_3_1_8b kv 512", SCHEDULES / "llama_3_1_8b.sched",
     (("kv tiles 4 slots of 256 tokens ahead 4", "kv tiles 5 slots of 512 tokens ahead 5"),))]
# Kernels wider than the shipped specs build (batches past 8, verify steps of 16 and 32 rows),
# where the compiler scratch was once extrapolated: (kernel, batch) beside batch 1, the largest
# batch and the verify step for the most sequences.
WIDER = {"gpt_oss_20b": [("decode", 16), ("verify", 2)], "gpt_oss_120b": [("decode", 16)],
         "qwen3_235b_a22b": [("decode", 16), ("verify", 2)], "qwen3_30b_a3b": [("decode", 16)],
         "deepseek_v3": [("decode", 16), ("decode", 32)], "kimi_k3": [("decode", 16)],
         "llama_3_1_8b": [("decode", 16), ("verify", 4)]}
# Verify steps past the shipped 8 rows a sequence (an outside sweep found a 4 KiB false fit at
# Qwen3-235B's `verify 16`): every spec with a verify line, for one sequence.
VERIFY_PAST = 16


@dataclass(frozen=True)
class Variant:
    name: str
    spec: str                          # relative to the repository
    edits: tuple[tuple[str, str], ...]
    kernel: str                        # "decode" | "verify"
    batch: int                         # decode rows, or verify sequences

    def text(self) -> str:
        text = (ROOT / self.spec).read_text()
        for old, new in self.edits:
            if old not in text:
                raise ValueError(f"{self.name}: '{old}' is not in {self.spec}")
            text = text.replace(old, new, 1)
        if self.kernel == "decode":
            text = re.sub(r"^ *verify .*\n", "", text, flags=re.M)
        return text


def _line(text: str, pattern: str) -> str:
    m = re.search(pattern, text, flags=re.M)
    if not m:
        raise ValueError(f"no line matches {pattern!r}")
    return m.group(0)


def _base_edits(text: str, kernel: str, batch: int, limit: str = "", rows: int = 0
                ) -> list[tuple[str, str]]:
    """Reserve 0 (and the limit `limit`, when given), no `expect` lines, no `refill` lines (they
    move no buffer, and a ring swept shallower than one holds back would be refused), a decode
    kernel's batch range 1 to its batch, and a verify kernel's sequences up to its `batch` (the
    batch range widened to hold them) at `rows` rows a sequence (0: the spec's own)."""
    edits = [(m.group(0), "") for m in re.finditer(r"^ *(expect|refill) .*\n", text, flags=re.M)]
    vmem = _line(text, r"vmem\s+limit \S+ \w+ reserve \S+ \w+")
    new = re.sub(r"reserve \S+ \w+", "reserve 0 MiB", vmem)
    edits.append((vmem, re.sub(r"limit \S+ \w+", f"limit {limit}", new) if limit else new))
    if kernel == "verify":
        line = _line(text, r"^ *verify +\d+.*$")
        m = re.match(r"( *verify +)(\d+)(?: sequences (\d+)(?: to (\d+))?)?", line)
        verify = f"{m.group(1)}{rows or m.group(2)}"
        if int(m.group(4) or m.group(3) or 1) != batch:
            edits.append((line, f"{verify} sequences 1 to {batch}"))
        elif verify != m.group(1) + m.group(2):
            edits.append((line, line.replace(m.group(1) + m.group(2), verify, 1)))
        b = _line(text, r"^ *batch +1 to \d+")
        if int(b.split()[-1]) < batch:
            edits.append((b, re.sub(r"1 to \d+", f"1 to {batch}", b)))
    if kernel == "decode":
        line = _line(text, r"^ *batch +1 to \d+")
        edits.append((line, re.sub(r"1 to \d+", f"1 to {batch}" if batch > 1 else "1", line)))
        # an all-reduce that scatters from more rows than the kernel has runs one-shot in it
        edits += [(m.group(0), m.group(1)) for m in SCATTER_FROM.finditer(text)
                  if int(m.group(2)) > batch]
    return edits


def _ring_edits(text: str, slots: int) -> list[tuple[str, str]]:
    ring = _line(text, r"ring weights: \d+ slots")
    ahead = _line(text, r"stream weights ahead \d+")
    return [(ring, f"ring weights: {slots} slots"),
            (ahead, f"stream weights ahead {min(slots, int(ahead.split()[-1]))}")]


def mkc_view(v: Variant) -> dict:
    """mkc's verdict on a variant with the current model: fits, peak and budget at its width."""
    from mkc.checks import capacity
    from mkc.diagnostics import MkcError
    from mkc.trace import build_trace
    try:
        s = resolve_text(v.text(), Path(v.spec).name)
    except MkcError as e:
        return {"error": f"{e.diagnostics[0].code}: {e.diagnostics[0].message}"}
    except ValueError as e:               # the spec changed since the variant was compiled
        return {"error": f"stale: {e}"}
    kernel = kernel_of(s, v.kernel, v.batch)
    rows = kernel.rows
    peak, _, _ = capacity.vmem_budget(s, build_trace(s), kernel)
    budget = capacity.vmem_budget_bytes(s)
    scratch = capacity.compiler_scratch(s, kernel)
    # libtpu's own measure at exactly this width, where the model takes the envelope of the
    # narrower widths' instead (a scratch that falls with rows: Muse Spark 2.49 MiB at 1 row,
    # 0.50 at 8)
    own = [m.bytes for m in s.compiler_scratch if m.key == capacity.scratch_key(s) and m.rows == rows
           and m.kernel.startswith("verify") == kernel.verify]
    return {"family": s.family, "rows": rows, "peak": peak, "budget": budget,
            "fits": peak <= budget, "scratch": scratch.bytes, "measured": scratch.measured,
            "envelope_over_measure": max(0, scratch.bytes - capacity.COMPILER_SCRATCH_MARGIN - max(own))
            if own else 0}


def _tag(name: str, kernel: str, batch: int, verify_rows: int) -> str:
    return f"{name} {kernel} " + (f"B{batch}" if kernel == "decode" else f"{verify_rows}x{batch}")


def _widths(name: str, shipped) -> list[tuple[str, int, int]]:
    """The swept kernels: (kernel, batch, verify rows a sequence, 0 for decode)."""
    widths = [("decode", 1, 0), ("decode", shipped.batch_max, 0)]
    if shipped.verify_rows:
        widths.append(("verify", shipped.verify_sequences[1], shipped.verify_rows))
    widths += [(k, b, shipped.verify_rows if k == "verify" else 0) for k, b in WIDER.get(name, ())]
    if shipped.verify_rows and shipped.verify_rows < VERIFY_PAST:
        widths.append(("verify", 1, VERIFY_PAST))
    return list(dict.fromkeys(widths))


def variants_of(name: str, spec: Path, formats, width: str | None = None) -> list[Variant]:
    """The spec's variants at each of its swept kernels (with `width`, as "decode B8" or
    "verify 8x2": at that one)."""
    rel = str(spec.relative_to(ROOT))
    text = spec.read_text()
    for old, new in formats:
        text = text.replace(old, new)
    shipped = resolve_text(text, spec.name)
    widths = _widths(name, shipped)
    if width is not None:
        widths = [w for w in widths if _tag(name, *w) == f"{name} {width}"]
    out = []
    for kernel, batch, rows in widths:
        tag = _tag(name, kernel, batch, rows)
        base = tuple(formats) + tuple(_base_edits(text, kernel, batch, rows=rows))
        base_view = mkc_view(Variant("", rel, base, kernel, batch))
        peak = base_view["peak"]
        if peak <= base_view["budget"]:      # a limit at mkc's peak is one the chip has
            at_peak = tuple(formats) + tuple(_base_edits(text, kernel, batch,
                                                         f"{math.ceil(peak / 1024)} KiB", rows))
            out.append(Variant(f"{tag} peak", rel, at_peak, kernel, batch))
        def fits(slots: int) -> bool:
            view = mkc_view(Variant("", rel, base + tuple(_ring_edits(text, slots)), kernel, batch))
            return "error" not in view and view["fits"]
        lo, hi = 0, 64                      # fits(lo) or lo == 0; not fits(hi + 1) assumed
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        deepest = lo
        for slots in (deepest, deepest + 1) if deepest else (1,):
            out.append(Variant(f"{tag} ring {slots}", rel, base + tuple(_ring_edits(text, slots)),
                               kernel, batch))
    return out


FITTING_KINDS = ("peak", "ring N")       # the kinds mkc says fit


def boundary_variant(name: str, width: str, kind: str) -> Variant:
    """One swept spec's variant: `width` as "decode B8" or "verify 8x2", `kind` one of KINDS
    ("peak" is "ring N" where mkc's peak at the spec's ring is over the chip's VMEM)."""
    _, spec, formats = next(x for x in SWEPT if x[0] == name)
    found = variants_of(name, spec, formats, width)
    rings = [v for v in found if not v.name.endswith(" peak")]
    if kind == "peak" and any(v.name.endswith(" peak") for v in found):
        return next(v for v in found if v.name.endswith(" peak"))
    return rings[0] if kind in ("peak", "ring N") and len(rings) == 2 else rings[-1]


def variants(only: str | None = None) -> list[Variant]:
    """Every swept spec's variants (with `only`: those whose name holds it)."""
    return [v for name, spec, formats in SWEPT for v in variants_of(name, spec, formats)
            if not only or only in v.name]


def compile_variant(v: Variant, timeout: float) -> dict:
    text = v.text()
    r = compile_kernel(text, resolve_text(text, Path(v.spec).name), v.kernel, v.batch, timeout)
    r["seconds"] = round(r.get("seconds", 0.0), 1)
    return r


# ---- the report -----------------------------------------------------------------------------
def classify(fits: bool, libtpu: str) -> str:
    if libtpu not in ("fits", "out_of_vmem"):
        return "n/a"
    if fits == (libtpu == "fits"):
        return "agree"
    return "FALSE FIT" if fits else "false overflow"


def report(results: list[dict]) -> tuple[str, dict]:
    lines = [f"{'variant':<46} {'libtpu':>6} {'used':>7} {'mkc':>7} {'budget':>7} {'margin':>7} "
             f"{'verdict':>14}"]
    totals: dict[str, dict] = {}
    for r in results:
        v, tpu = Variant(**{**r["var"], "edits": tuple(map(tuple, r["var"]["edits"]))}), r["libtpu"]
        m = mkc_view(v)
        if "error" in m:
            lines.append(f"{v.name:<46} mkc error: {m['error']}")
            continue
        verdict = classify(m["fits"], tpu["libtpu"])
        used = tpu.get("used_bytes")
        margin = (m["peak"] - used) / MIB if m["fits"] and tpu["libtpu"] == "fits" else None
        fam = totals.setdefault(m["family"], {"points": 0, "agree": 0, "FALSE FIT": 0,
                                              "false overflow": 0, "margins": [], "at_peak": []})
        if verdict != "n/a":
            fam["points"] += 1
            fam[verdict] += 1
        if margin is not None:
            fam["at_peak" if v.name.endswith(" peak") else "margins"].append(margin)
        shown = {"fits": "fits", "out_of_vmem": "OOM"}.get(tpu["libtpu"], tpu["libtpu"])
        lines.append(f"{v.name:<46} {shown:>6} {used / MIB if used else float('nan'):7.2f} "
                     f"{m['peak'] / MIB:7.2f} {m['budget'] / MIB:7.2f} "
                     f"{'' if margin is None else f'{margin:+7.2f}':>7} {verdict:>14}")
    lines.append("")
    lines.append(f"{'family':<20} {'points':>6} {'agree':>6} {'false fits':>10} "
                 f"{'false overflows':>15}  margin min / median / max (MiB): at the chip's VMEM; "
                 "at mkc's peak as the limit (libtpu spills less there)")

    def span(ms: list[float]) -> str:
        ms = sorted(ms)
        return f"{ms[0]:+.2f} / {ms[len(ms) // 2]:+.2f} / {ms[-1]:+.2f}" if ms else "-"
    for fam, t in sorted(totals.items()):
        lines.append(f"{fam:<20} {t['points']:>6} {t['agree']:>6} {t['FALSE FIT']:>10} "
                     f"{t['false overflow']:>15}  {span(t['margins'])}; {span(t['at_peak'])}")
    secs = sum(r["libtpu"].get("seconds", 0) for r in results)
    lines.append(f"{len(results)} variants, {secs / 60:.0f} min of libtpu compiles; reproduce: "
                 f"{COMMAND} (compiles; --report reads {DATA.relative_to(ROOT)})")
    return "\n".join(lines), totals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", action="store_true", help="only report from the saved data")
    ap.add_argument("--only", help="variants whose name contains this")
    ap.add_argument("--missing", action="store_true", help="only variants not in the data yet")
    ap.add_argument("--list", action="store_true", help="list the variants and stop")
    ap.add_argument("--timeout", type=float, default=1200.0)
    a = ap.parse_args(argv)
    old = {r["var"]["name"]: r for r in json.loads(DATA.read_text())["results"]
           if "spec" in r["var"]} if DATA.exists() else {}
    if not a.report:
        swept = variants(a.only)
        todo = [v for v in swept if not (a.missing and v.name in old)]
        if a.list:
            print("\n".join(v.name for v in todo))
            return 0
        # results of variants the specs no longer make (a boundary moved) go
        current = {v.name for v in swept}
        old = {n: r for n, r in old.items() if (a.only or "") not in n or n in current}
        for i, v in enumerate(todo):
            r = compile_variant(v, a.timeout)
            old[v.name] = {"var": asdict(v), "libtpu": r}
            print(f"[{i + 1}/{len(todo)}] {v.name}: {r['libtpu']} "
                  f"{(r.get('used_bytes') or 0) / MIB:.2f} MiB in {r['seconds']} s", flush=True)
            _save(old)
        _save(old)
    text, totals = report(sorted(old.values(), key=lambda r: r["var"]["name"]))
    print(text)
    return 1 if any(t["FALSE FIT"] for t in totals.values()) else 0


def _save(results: dict) -> None:
    DATA.write_text(json.dumps({"command": COMMAND, "jax": _versions(),
                                "results": sorted(results.values(), key=lambda r: r["var"]["name"])},
                               indent=1) + "\n")


def _versions() -> dict:
    from importlib.metadata import version
    return {p: version(p) for p in ("jax", "jaxlib", "libtpu")}


if __name__ == "__main__":
    sys.exit(main())

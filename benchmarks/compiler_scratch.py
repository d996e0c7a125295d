"""Measure the VMEM libtpu allocates beyond mkc's buffers (the register allocator's spill slots,
Mosaic's internal scratch, allocation rounding) for the kernels each family ships, and write it
into the family's `compiler_scratch.json`, which `mkc check` reads (mkc.checks.capacity).

Each point is a spec (a shipped one, or one with its weight formats edited) and a kernel: the
decode step at a batch, or the verify step of R rows for S sequences. The spec's reserve is set
to 0 and its `expect` lines dropped; the module is rendered and compiled with libtpu
compile-only for the spec's topology in a fresh subprocess (mkc.confirm.run_compile). The
kernel's VMEM use is read exactly from the compiled HLO; mkc's count is its peak of buffers and
windows at the kernel's rows (`capacity.vmem_budget` less the modelled scratch). The measure is
the difference. A kernel that does not fit at the chip's VMEM is measured with its weight ring 2
slots shallower (the scratch does not depend on the ring's depth). With --llo, libtpu's final
LLO is dumped and the spill slots' peak read from its allocations (`spill_bytes`; slower).

    .venv/bin/python benchmarks/compiler_scratch.py                 # every point (~40 min)
    .venv/bin/python benchmarks/compiler_scratch.py --only gpt_oss  # points whose name has it
    .venv/bin/python benchmarks/compiler_scratch.py --spec SPEC     # a spec of your own, at
                                                       # batch 1, its largest and its verify step
    .venv/bin/python benchmarks/compiler_scratch.py --list          # the points, no compiling
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from bundles import (DENSE_FORMATS, K3_SPEC, QWEN_MOE_SPEC, QWEN_SPEC, dense_edits,  # noqa: E402
                     format_edits)
COMMAND = ".venv/bin/python benchmarks/compiler_scratch.py"
MIB = 2**20
SCHEDULES = ROOT / "schedules"
# K3's routed experts in FP8 blocks (exact while packing's check passes) and in rounded FP4
# blocks instead of the shipped MXFP4; Qwen3.5-35B-A3B's in rounded FP8 blocks instead of bf16;
# K3's and Qwen 27B's dense classes as rounded FP8 or int8 codes (`points`).
K3_FP8, K3_FP4 = format_edits(K3_SPEC, "fp8 block"), format_edits(K3_SPEC, "fp4 block")
QWEN_MOE_FP8 = format_edits(QWEN_MOE_SPEC, "fp8 block")

# An all-reduce's scatter clause from N rows (group 1: the line before it): a kernel of fewer
# rows runs it one-shot, so a spec cut to that kernel drops the clause.
SCATTER_FROM = re.compile(r"^( *allreduce .*?) scatter\b.*? from (\d+) rows", re.M)


@dataclass(frozen=True)
class Point:
    name: str
    spec: Path
    kernel: str                     # "decode" | "verify"
    batch: int                      # decode rows, or verify sequences
    edits: tuple[tuple[str, str], ...] = ()


def _spec_points(name: str, spec: Path, widths: tuple[int, ...] | None = None,
                 edits: tuple[tuple[str, str], ...] = ()) -> list[Point]:
    """Decode at batch 1 and the spec's largest (or `widths`), and its verify step if any."""
    s = resolve_text(_edited(spec, edits))
    points = [Point(f"{name} decode B{b}", spec, "decode", b, edits)
              for b in widths or sorted({1, s.batch_max})]
    if s.verify_rows:
        S = s.verify_sequences[1]
        points.append(Point(f"{name} verify {s.verify_rows}x{S}", spec, "verify", S, edits))
    return points


# Each family's KV tiles at twice the shipped length (its bytes a token past a measure).
KV_256 = {"qwen3_8_27b": ("kv tiles 5 slots of 128 tokens", "kv tiles 5 slots of 256 tokens"),
          "qwen3_5_35b_a3b": ("kv tiles 4 slots of 128 tokens", "kv tiles 4 slots of 256 tokens"),
          "kimi_k3": ("kv tiles 3 slots of 256 tokens", "kv tiles 3 slots of 512 tokens"),
          "llama_3_1_8b": ("kv tiles 4 slots of 256 tokens", "kv tiles 4 slots of 512 tokens"),
          "qwen3_30b_a3b": ("kv tiles 5 slots of 128 tokens", "kv tiles 5 slots of 256 tokens"),
          "deepseek_v3": ("kv tiles 3 slots of 256 tokens", "kv tiles 3 slots of 512 tokens"),
          **{name: ("phase gqa {\n    kv tiles 3 slots of 128", "phase gqa {\n    kv tiles 3 slots of 256")
             for name in ("gpt_oss_20b", "gpt_oss_120b")}}


def points() -> list[Point]:
    p = []
    for spec in sorted(SCHEDULES.glob("*.sched")):
        p += _spec_points(spec.stem, spec)
    p += _spec_points("kimi_k3 fp8 experts", SCHEDULES / "kimi_k3.sched", edits=K3_FP8)
    p += _spec_points("kimi_k3 fp4 experts", SCHEDULES / "kimi_k3.sched", edits=K3_FP4)
    p += _spec_points("qwen3_5_35b_a3b fp8 experts", QWEN_MOE_SPEC, edits=QWEN_MOE_FP8)
    for fmt in DENSE_FORMATS:       # the dense classes as codes (bundles.DENSE_CLASSES)
        p += _spec_points(f"qwen3_8_27b dense {fmt}", QWEN_SPEC, edits=dense_edits(QWEN_SPEC, fmt))
        p += _spec_points(f"kimi_k3 dense {fmt}", K3_SPEC, edits=dense_edits(K3_SPEC, fmt))
        p += _spec_points(f"kimi_k3 dense {fmt} attention", K3_SPEC,
                          edits=dense_edits(K3_SPEC, fmt, attention=True))
    p += [Point(f"{name} kv 256 decode B8", SCHEDULES / f"{name}.sched", "decode", 8, (edit,))
          for name, edit in KV_256.items()]
    p.append(Point("kimi_k3 fp4 experts kv 256 decode B8", SCHEDULES / "kimi_k3.sched", "decode", 8,
                   (KV_256["kimi_k3"], *K3_FP4)))
    p.append(Point("qwen3_5_35b_a3b fp8 experts kv 256 decode B8", QWEN_MOE_SPEC, "decode", 8,
                   (KV_256["qwen3_5_35b_a3b"], *QWEN_MOE_FP8)))
    # wider than the shipped kernels: past them the scratch is only a bound (mkc.checks.capacity)
    p += [Point(f"{name} {kernel} {'B' if kernel == 'decode' else 'S'}{n}", SCHEDULES / f"{name}.sched",
                kernel, n) for name, kernel, n in WIDER]
    # more rows a sequence for fewer sequences than a measure at as many rows (its KV tiles hold
    # fewer entries: spill that hid behind the measured kernel's shows, mkc.checks.capacity)
    p += [Point(f"{name} verify R{rows} S{n}", SCHEDULES / f"{name}.sched", "verify", n,
                ((old, f"verify {rows}"),)) for name, old, rows, n in ROWS_A_SEQUENCE]
    p += [Point(f"{name} verify S{n}", SCHEDULES / f"{name}.sched", "verify", n)
          for name, n in FEWER_SEQUENCES]
    return p


# (spec, kernel, batch or sequences) measured past the shipped widths
WIDER = [("gpt_oss_20b", "decode", 16), ("gpt_oss_120b", "decode", 16), ("qwen3_30b_a3b", "decode", 16),
         ("qwen3_235b_a22b", "decode", 16), ("llama_3_1_8b", "decode", 16), ("deepseek_v3", "decode", 16),
         ("deepseek_v3", "decode", 32), ("kimi_k3", "decode", 16), ("qwen3_235b_a22b", "verify", 2),
         ("gpt_oss_20b", "verify", 2), ("llama_3_1_8b", "verify", 4)]
# (spec, its verify line, rows a sequence, sequences) measured past the shipped rows a sequence
ROWS_A_SEQUENCE = [("qwen3_235b_a22b", "verify  8", 16, 1)]
# (spec, sequences) verify steps of fewer sequences than the spec's most, where no measure
# holds as few KV tile entries at their rows (a measure of more hides spill behind its tiles).
# Not Llama 70B's: its 7-row verify step uses more than its 8-row one (48.96 MiB against 47.96,
# libtpu 0.0.50.1), so a measure at 8 rows would be read as the narrower kernels' and fall short.
FEWER_SEQUENCES = [("llama_3_1_8b", 1), ("qwen3_8_27b", 1)]


# ---- mkc's side -----------------------------------------------------------------------------
def _edited(spec: Path, edits) -> str:
    text = spec.read_text()
    for old, new in edits:
        if old not in text:
            raise ValueError(f"{spec.name}: '{old}' is not in it")
        text = text.replace(old, new)
    return text


def resolve_text(text: str, name: str = "spec.sched"):
    from mkc.lang.parser import parse
    from mkc.resolve import resolve
    return resolve(parse(text, name), None)


def measured_text(p: Point, ring_shrink: int = 0) -> str:
    """The point's spec as compiled: reserve 0, no `expect` lines; a verify point's sequences
    up to its own; a decode point at its batch with no verify step (an all-reduce that
    scatters from more rows than that runs one-shot in it, a refill held back from more rows
    starts as its tiles are read); the weight ring `ring_shrink`
    slots shallower."""
    text = _edited(p.spec, p.edits)
    text = re.sub(r"(vmem\s+limit \S+ \w+) reserve \S+ \w+", r"\1 reserve 0 MiB", text)
    text = re.sub(r"^ *expect .*\n", "", text, flags=re.M)
    if p.kernel == "verify":                 # sequences up to the point's (the batch range too)
        m = re.search(r"^( *verify +\d+)(?: sequences (\d+)(?: to (\d+))?)?[ \t]*$", text, flags=re.M)
        if int(m.group(3) or m.group(2) or 1) < p.batch:
            text = text.replace(m.group(0), f"{m.group(1)} sequences 1 to {p.batch}")
        b = re.search(r"^( *batch +1 to )(\d+)", text, flags=re.M)
        if int(b.group(2)) < p.batch:
            text = text.replace(b.group(0), f"{b.group(1)}{p.batch}")
    if p.kernel == "decode":
        text = re.sub(r"^ *verify .*\n", "", text, flags=re.M)
        text = re.sub(r"^( *batch +)1 to \d+", rf"\g<1>1 to {p.batch}" if p.batch > 1 else r"\g<1>1",
                      text, count=1, flags=re.M)
        text = SCATTER_FROM.sub(lambda m: m.group(1) if int(m.group(2)) > p.batch else m.group(0),
                                text)
        # refills held back from more rows than it runs start as their tiles are read in it
        text = re.sub(r"^ *refill .* from (\d+) rows[ \t]*(#.*)?\n",
                      lambda m: "" if int(m.group(1)) > p.batch else m.group(0), text, flags=re.M)
    if ring_shrink:
        m = re.search(r"ring weights: (\d+) slots", text)
        slots = max(1, int(m.group(1)) - ring_shrink)
        text = text.replace(m.group(0), f"ring weights: {slots} slots")
        text = re.sub(r"stream weights ahead (\d+)",
                      lambda a: f"stream weights ahead {min(slots, int(a.group(1)))}", text)
    return text


def mkc_count(s, kernel) -> int:
    """mkc's peak of buffers and windows for `kernel` (a `capacity.Kernel`): its modelled peak
    less its modelled compiler scratch (a constant, resident all kernel)."""
    from mkc.checks import capacity
    from mkc.trace import build_trace
    peak, _, _ = capacity.vmem_budget(s, build_trace(s), kernel)
    return peak - capacity.compiler_overhead_bytes(s, kernel)


# ---- libtpu's side --------------------------------------------------------------------------
def _spill_peak(llo_dir: Path) -> int:
    """The spill slots' peak in the kernel's post-register-allocation LLO: allocations tagged
    'spilled vreg' in VMEM, a region's own plus the largest of its sub-regions' (sibling regions
    run one after another and share memory)."""
    files = sorted((f for f in llo_dir.glob("*-post-ra.txt") if re.search(r"-\d+-post-ra\.txt$", f.name)),
                   key=lambda f: f.stat().st_size)
    if not files:
        return -1
    own: dict[int, int] = collections.Counter()
    kids: dict[int, list[int]] = collections.defaultdict(list)
    region = None
    with open(files[-1]) as f:
        for line in f:
            m = re.match(r"\s*\$region(\d+): #\{[^}]*\}(?: parent=(\d+))?", line)
            if m:
                region = int(m.group(1))
                if m.group(2):
                    kids[int(m.group(2))].append(region)
                continue
            m = re.match(r"\s+#allocation\w* \[shape = '[^']*', space=vmem, size = (0x[0-9a-f]+)"
                         r".*tag = 'spilled vreg", line)
            if m and region is not None:
                own[region] += int(m.group(1), 16)

    def peak(r: int) -> int:
        return own[r] + max((peak(k) for k in kids[r]), default=0)
    sys.setrecursionlimit(100000)
    return peak(0)


def kernel_rows(s, kernel: str, batch: int) -> int:
    """Rows of the kernel: a decode step's batch, or a verify step's R rows for `batch`
    sequences."""
    return batch * (s.verify_rows if kernel == "verify" else 1)


def kernel_of(s, kernel: str, batch: int):
    """The `capacity.Kernel` of a decode step at `batch` or a verify step for `batch`
    sequences of the spec's R rows."""
    from mkc.checks.capacity import Kernel
    return Kernel(kernel_rows(s, kernel, batch), batch, kernel == "verify")


def compile_kernel(text: str, s, kernel: str, batch: int, timeout: float, llo: bool = False
                   ) -> dict:
    """The spec's module rendered and its kernel ("decode" at `batch` rows, or "verify" for
    `batch` sequences) compiled by libtpu in a subprocess: `mkc.confirm.run_compile`'s verdict,
    and with `llo` the spill slots' peak from the dumped LLO ("spill_bytes", else -1)."""
    from mkc.codegen.emit import render
    from mkc.confirm import run_compile
    with tempfile.TemporaryDirectory(prefix="mkc-scratch-") as tmp:
        module = Path(tmp) / f"{s.name}.py"
        module.write_text(render(s, text))
        old = os.environ.get("LIBTPU_INIT_ARGS")
        if llo:
            os.environ["LIBTPU_INIT_ARGS"] = (f"--xla_jf_dump_to={tmp}/jf "
                                              "--xla_jf_dump_llo_text=true")
        try:
            r = run_compile(module, batch, timeout,
                            verify_rows=s.verify_rows if kernel == "verify" else None)
        finally:
            if old is None:
                os.environ.pop("LIBTPU_INIT_ARGS", None)
            else:
                os.environ["LIBTPU_INIT_ARGS"] = old
        r["spill_bytes"] = _spill_peak(Path(tmp) / "jf") if llo and r["libtpu"] == "fits" else -1
    return r


def measure(p: Point, llo: bool, timeout: float) -> dict | None:
    from importlib.metadata import version

    from mkc.checks import capacity
    for shrink in (0, 2, 4, 6):
        text = measured_text(p, shrink)
        s = resolve_text(text, p.spec.name)
        rows = kernel_rows(s, p.kernel, p.batch)
        counted = mkc_count(s, kernel_of(s, p.kernel, p.batch))
        if counted > capacity.usable_vmem_bytes(s) - (1 << 20):
            continue                  # hopeless: a shallower ring first
        r = compile_kernel(text, s, p.kernel, p.batch, timeout, llo)
        print(f"  {p.name} ring -{shrink}: libtpu {r['libtpu']} "
              f"{(r.get('used_bytes') or 0) / MIB:.2f} MiB, mkc counts {counted / MIB:.2f} MiB "
              f"({r.get('seconds', 0):.0f} s)", flush=True)
        if r["libtpu"] == "out_of_vmem":
            continue
        if r["libtpu"] != "fits" or not r.get("used_bytes"):
            print(f"  {p.name}: {r['libtpu']}: {r.get('message', '')[:300]}", flush=True)
            return None
        tokens = max((k.kv.tokens for k in s.kinds.values() if k.kv), default=0)
        kernel = "decode" if p.kernel == "decode" else f"verify {s.verify_rows} x {p.batch}"
        return {"key": [list(kv) for kv in capacity.scratch_key(s)], "model": s.model,
                "kernel": kernel, "rows": rows, "kv_tokens": tokens,
                "bytes": r["used_bytes"] - counted, "spill_bytes": r["spill_bytes"],
                "used_bytes": r["used_bytes"], "libtpu": f"libtpu {version('libtpu')}",
                "family": s.family, "point": p.name, "family_package": s.family_package}
    return None


# ---- the data -------------------------------------------------------------------------------
def family_file(package: str) -> Path:
    from mkc.model.family import SCRATCH_FILE
    return ROOT / Path(*package.split(".")) / SCRATCH_FILE


def save(m: dict) -> Path:
    """Add (or replace) a measure in its family's file, kept sorted so it is reproducible."""
    from mkc.ir import ScratchMeasure
    path = family_file(m["family_package"])
    data = json.loads(path.read_text()) if path.exists() else {}
    fields = {f for f in ScratchMeasure.__dataclass_fields__}
    new = {k: v for k, v in m.items() if k in fields}
    ident = ("key", "kernel", "rows", "kv_tokens")
    keep = [x for x in data.get("measures", []) if [x[k] for k in ident] != [new[k] for k in ident]]
    measures = sorted(keep + [new], key=lambda x: (json.dumps(x["key"]), x["kv_tokens"], x["rows"],
                                                   x["kernel"]))
    path.write_text(json.dumps({
        "what": "VMEM libtpu allocates beyond mkc's count of buffers and windows (spill slots, "
                "internal scratch), per geometry (mkc.checks.capacity.scratch_key) and kernel",
        "command": COMMAND, "measures": measures}, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="points whose name contains this")
    ap.add_argument("--spec", type=Path, help="measure this spec (batch 1, largest, verify)")
    ap.add_argument("--llo", action="store_true", help="also read the spill slots from the LLO")
    ap.add_argument("--list", action="store_true", help="list the points and stop")
    ap.add_argument("--timeout", type=float, default=1200.0)
    a = ap.parse_args(argv)
    todo = _spec_points(a.spec.stem, a.spec) if a.spec else points()
    todo = [p for p in todo if not a.only or a.only in p.name]
    for p in todo:
        print(p.name)
    if a.list:
        return 0
    failed = 0
    for i, p in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] {p.name}", flush=True)
        m = measure(p, a.llo, a.timeout)
        if m is None:
            failed += 1
            continue
        path = save(m)
        spill = f", spill slots {m['spill_bytes'] / MIB:.2f} MiB" if m["spill_bytes"] >= 0 else ""
        print(f"  scratch {m['bytes'] / MIB:.3f} MiB at {m['rows']} rows{spill} -> "
              f"{path.relative_to(ROOT)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

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
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
COMMAND = ".venv/bin/python benchmarks/bundles.py"


# K3's routed experts in each format libtpu's pack-group probe compares
# (benchmarks/format_probe.py --bundles): the model's ratio of their prices must follow it. The
# shipped spec's are the checkpoint's MXFP4 (exact); "fp4 block" rounds, under the searched bf16
# block scale (the least error at about E8M0's cost: docs/formats.md#which-block-scale).
K3_FORMATS = {"mxfp4": ("mxfp4", "mxfp4"), "fp8": ("fp8", "fp8"),
              "fp8 block": ("fp8 block 512", "fp8 block 128"),
              "fp4 block": ("fp4 block 512 rounded scale bf16", "fp4 block 128 rounded scale bf16")}
K3_SPEC = ROOT / "schedules" / "kimi_k3.sched"
# Qwen3.5-35B-A3B's: the shipped spec's are the checkpoint's bf16; "fp8 block" rounds.
QWEN_MOE_FORMATS = {"bf16": ("bf16", "bf16"),
                    "fp8 block": ("fp8 block 512 rounded scale bf16", "fp8 block 128 rounded scale bf16")}
QWEN_MOE_SPEC = ROOT / "schedules" / "qwen3_5_35b_a3b.sched"
# Each shipped spec whose routed experts are offered in other formats: those formats by name.
EXPERT_FORMATS = {K3_SPEC: K3_FORMATS, QWEN_MOE_SPEC: QWEN_MOE_FORMATS}
# Formats whose larger expert slots the shipped geometry cannot hold beside its ring: the
# other line edits that make them fit (one ring slot fewer), at the VMEM margin the spec expects.
_K3_RING_SLOT_FEWER = (("ring weights: 8 slots", "ring weights: 7 slots"),
                       ("stream weights ahead 8", "stream weights ahead 7"))
# FP8 with a scale per 32 rows also leaves no room for the overlapped shared-expert sum's own
# buffers: it runs that sum at once.
_K3_SHARED_SUM_AT_ONCE = (("allreduce shared_down two_level host wire bf16 scatter overlap",
                           "allreduce shared_down two_level host wire bf16 scatter from 8 rows"),)
FORMAT_GEOMETRY = {(K3_SPEC, "fp8"): _K3_RING_SLOT_FEWER + _K3_SHARED_SUM_AT_ONCE,
                   (K3_SPEC, "fp8 block"): _K3_RING_SLOT_FEWER}
CALIBRATION = ROOT / "benchmarks" / "data" / "calibration" / "kimi_k3.sched"

# The dense classes (`format CLASS fp8|int8 channel rounded`: 8-bit codes with a scale per
# output column, `mkc.layers.dense_formats`; rounded) of K3, Qwen 27B and Muse Spark: the
# classes each spec's variants store as codes, the shipped spec keeping them bf16. K3's attention is not
# among them: its pooled matrices (the `staging.attention` view) stay bf16, and a class's
# matrices all stream (`K3_DENSE_ATTENTION` streams them, a geometry of its own).
QWEN_SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"
MUSE_SPEC = ROOT / "schedules" / "muse_spark.sched"
DENSE_CLASSES = {K3_SPEC: ("mlp", "shared_expert", "latent", "lm_head"),
                 QWEN_SPEC: ("attention", "mlp", "lm_head"),
                 MUSE_SPEC: ("attention", "latent", "lm_head")}
DENSE_FORMATS = ("fp8", "int8")
# K3 with its latent class as codes: latent_down streams, and the router with it (in the
# family's order), so the pool's attention view holds attention's matrices only and is not
# opened between attention and the MoE.
K3_DENSE_LATENT = (
    ("mla(kv_down, q_up, key_up, value_up, gate), moe(latent_down, router)",
     "mla(kv_down, q_up, key_up, value_up, gate)"),
    ("    moe: shared_gate_up", "    moe: router, latent_down, shared_gate_up"),
    ("    run latent_down before router", "    # (latent_down streams after the router)"),
    ("wait before next kda\n    # the MoE's latent_down and router, copied under the o_proj sum\n"
     "    prefetch next staging.attention after o_proj",
     "wait before next kda\n    # (latent_down and the router stream)\n    #"),
    ("phase mla {\n    # the MoE's latent_down and router, copied under the o_proj sum\n"
     "    prefetch next staging.attention after o_proj",
     "phase mla {\n    # (latent_down and the router stream)\n    #"))
# K3 with its attention as codes too: the pool view keeps what MLA reads whole (key_up,
# value_up), and the kda and mla projections it held stream; the dense phase, followed by a
# kda layer, prefetches nothing.
K3_DENSE_ATTENTION = (
    ("view attention: kda(gate_up, projection), mla(kv_down, q_up, key_up, value_up, gate)",
     "view attention: mla(key_up, value_up)"),
    ("    kda: gate_down, o_proj", "    kda: gate_down, gate_up, projection, o_proj"),
    ("    mla: q_down, o_proj", "    mla: q_down, kv_down, q_up, gate, o_proj"),
    # the layer after the dense MLP is a kda layer, which reads nothing of the view now
    ("    prefetch next staging.attention after down", "    # (no view to prefetch: kda)"))


# Muse Spark with its attention and latent classes as codes: o_proj streams after qkv_gate (as
# latent_down does in the shipped spec), so the pool's dense view holds the router only, copied
# under the o_proj sum as before; the MoE has no next view to prefetch.
MUSE_DENSE_STREAMED = (
    ("view dense: swa(o_proj), full(o_proj), moe(router), moe_bf16(router)",
     "view dense: moe(router), moe_bf16(router)"),
    ("    swa: qkv_gate\n", "    swa: qkv_gate, o_proj\n"),
    ("    full: qkv_gate\n", "    full: qkv_gate, o_proj\n"),
    ("    # the next layer's o_proj, once the experts are done with the pool\n"
     "    prefetch next staging.dense after routed_experts",
     "    # (o_proj streams)\n    #"),
    ("    # then the next layer's o_proj, and the ring's refills\n"
     "    prefetch next staging.dense after routed_experts",
     "    # (o_proj streams)\n    #"))

# The edits a spec's dense variants need beyond their `format` lines (a class as codes streams).
DENSE_GEOMETRY = {K3_SPEC: K3_DENSE_LATENT, MUSE_SPEC: MUSE_DENSE_STREAMED}


def format_edits(spec: Path, formats: str | tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """(old, new) line edits taking a shipped spec's routed experts to `formats`: a key of its
    EXPERT_FORMATS, or the (gate_up, down) formats as a spec writes them after the class, with
    the FORMAT_GEOMETRY edits a named format needs. The lines keep their place, so the spec's
    other lines keep their numbers."""
    text = spec.read_text()
    edits = []
    for cls, now in zip(("gate_up", "down"), EXPERT_FORMATS.get(spec, {}).get(formats, formats)):
        m = re.search(rf"^ *format expert\.{cls} .*$", text, flags=re.M)
        assert m, f"{spec.name} has no `format expert.{cls}` line"
        edits.append((m.group(0), re.sub(r"format (\S+) .*", rf"format \1 {now}", m.group(0))))
    if isinstance(formats, str):
        for old, new in FORMAT_GEOMETRY.get((spec, formats), ()):
            line = next(ln for ln in text.splitlines() if old in ln)
            edits.append((line, line.replace(old, new)))
    return tuple(edits)


def format_text(spec: Path, formats: str | tuple[str, str]) -> str:
    """The shipped spec with its routed experts in `formats` (as `format_edits`)."""
    text = spec.read_text()
    for old, new in format_edits(spec, formats):
        text = text.replace(old, new)
    return text


def dense_edits(spec: Path, fmt: str, attention: bool = False) -> tuple[tuple[str, str], ...]:
    """(old, new) edits storing the spec's `DENSE_CLASSES` as `fmt` ("fp8" or "int8") codes
    with a scale per output column (rounded): their `format` lines joined to the schedule's
    closing brace, so every other line keeps its number; K3's latent class streamed
    (`K3_DENSE_LATENT`), and with `attention` its attention too (`K3_DENSE_ATTENTION`); Muse
    Spark's o_proj and latent_down streamed (`MUSE_DENSE_STREAMED`): `DENSE_GEOMETRY`. The
    schedule is renamed for the variant (`dense_name`): its compiled measures keep a file of
    their own."""
    classes = DENSE_CLASSES[spec] + (("attention",) if attention else ())
    lines = "".join(f"  format {c} {fmt} channel rounded\n" for c in classes)
    text = spec.read_text()
    assert text.endswith("\n}\n"), f"{spec.name} does not end with its schedule's brace"
    head = f"schedule {spec.stem} {{"
    edits = ((head, f"schedule {dense_name(spec, fmt, attention)} {{"),
             ("\n}\n", "\n" + lines + "}\n"))
    return edits + DENSE_GEOMETRY.get(spec, ()) + (K3_DENSE_ATTENTION if attention else ())


def dense_name(spec: Path, fmt: str, attention: bool = False) -> str:
    """The schedule name of a dense variant: `qwen3_8_27b_fp8_channel`,
    `kimi_k3_attention_int8_channel`."""
    return f"{spec.stem}{'_attention' if attention else ''}_{fmt}_channel"


def dense_text(spec: Path, fmt: str, attention: bool = False) -> str:
    """The shipped spec with its dense classes in `fmt` codes (as `dense_edits`)."""
    text = spec.read_text()
    for old, new in dense_edits(spec, fmt, attention):
        assert text.count(old) == 1, f"{spec.name}: {old!r} is not there once"
        text = text.replace(old, new) if old != "\n}\n" else text[:-len(old)] + new
    return text


def kernels(s) -> list[tuple[str, int]]:
    out = [("decode", b) for b in sorted({1, s.batch_max})]
    if s.verify_rows:
        out.append(("verify", s.verify_sequences[0]))      # `mkc perf --verify R`'s default
    return out


def points():
    """(name, checked IR, kernel, rows or sequences) of every measure shipped."""
    from mkc import compiler
    out = []
    for spec in [*sorted((ROOT / "schedules").glob("*.sched")), CALIBRATION]:
        s = compiler.check_spec(str(spec)).ir
        name = spec.stem if spec != CALIBRATION else "calibration kimi_k3"
        out += [(name, s, kernel, batch) for kernel, batch in kernels(s)]
    for fmt in K3_FORMATS:
        s = compiler.check_source(format_text(K3_SPEC, fmt), str(K3_SPEC)).ir
        out.append((f"kimi_k3 experts {fmt}", s, "decode", 8))
    for fmt in QWEN_MOE_FORMATS:        # the rounded variant's kernels (bf16: the shipped spec's)
        if QWEN_MOE_FORMATS[fmt] != ("bf16", "bf16"):
            s = compiler.check_source(format_text(QWEN_MOE_SPEC, fmt), str(QWEN_MOE_SPEC)).ir
            out += [(f"qwen3_5_35b_a3b experts {fmt}", s, kernel, b) for kernel, b in kernels(s)]
    for name, spec, attention in dense_variants():
        for fmt in DENSE_FORMATS:
            s = compiler.check_source(dense_text(spec, fmt, attention), str(spec)).ir
            out += [(f"{name} dense {fmt}", s, "decode", b) for b in (1, 8)]
    return out


def dense_variants() -> list[tuple[str, Path, bool]]:
    """(name, shipped spec, with K3's attention) of each spec whose dense classes the variants
    store as codes (`dense_text`)."""
    return [("qwen3_8_27b", QWEN_SPEC, False), ("kimi_k3", K3_SPEC, False),
            ("kimi_k3 attention", K3_SPEC, True), ("muse_spark", MUSE_SPEC, False)]


def main(argv: list[str] | None = None) -> int:
    from mkc.perf import bundles
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="specs whose name contains this")
    ap.add_argument("--check", action="store_true", help="list stale or missing entries")
    args = ap.parse_args(argv)
    stale = 0
    every = points()
    if not args.check:
        drop_stale(every, {s.name for name, s, _, _ in every if args.only in name})
    for name, s, kernel, batch in every:
        if args.only not in name:
            continue
        if args.check:
            have = bundles.cached(s, kernel, batch, places=(bundles.DATA,))
            stale += have is None
            print(f"{name} {kernel} {batch}: {'fresh' if have else 'stale or missing'}")
            continue
        have = bundles.cached(s, kernel, batch)
        t0 = time.perf_counter()
        entry = have or bundles.measure(s, kernel, batch)      # the user's cache, if it has it
        bundles.save(entry, bundles.DATA)
        top = max(entry["rows"], key=lambda r: bundles.per_step(entry, r))
        print(f"{name} {kernel} {batch}: {entry['bundles']} bundles, costliest row "
              f"{top['key']} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 1 if args.check and stale else 0


def drop_stale(every: list, specs: set[str]) -> None:
    """The shipped measures of `specs` (by schedule name: a file each) that no point measures
    any more (its spec, the code it traces to or libtpu changed) go first, so that a file's
    limit (`bundles.KEEP`) never drops a fresh measure for a stale one."""
    import json

    from mkc.codegen.emit import render
    from mkc.files import write_atomically
    from mkc.perf import bundles
    libtpu = bundles.libtpu_version()
    current: dict[str, set[str]] = {}
    for _, s, kernel, batch in every:
        if s.name in specs:
            current.setdefault(s.name, set()).add(bundles.cache_key(
                render(s, ""), kernel, batch, libtpu, s.verify_rows if kernel == "verify" else None))
    for spec, keys in current.items():
        path = bundles.DATA / f"{spec}.json"
        if not path.exists():
            continue
        entries = json.loads(path.read_text())["measures"]
        fresh = [e for e in entries if e.get("key") in keys]
        if len(fresh) < len(entries):
            write_atomically(path, json.dumps({"measures": fresh}, indent=1, sort_keys=True) + "\n")
            print(f"{spec}: {len(entries) - len(fresh)} stale measures dropped", flush=True)


if __name__ == "__main__":
    sys.exit(main())

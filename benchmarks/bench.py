"""Benchmarks, for the Qwen 3.8 27B and Kimi K3 schedules: how fast `mkc check` answers a spec
with a syntax error and one with a resolve error (CLI wall time: the diagnostics' latency), mkc
compile time of the full spec (in process and as the CLI), libtpu compile time of the
generated full-size kernel at batch 1 and 8, interpret-mode time per MINI decode step (with the
lean host side the runners use and with JAX's own, side by side), and the VMEM peaks. Prints
medians and the command that reproduces each number. `--tiers` times the test tiers instead;
`--modelled` prints every shipped spec's modelled steps; `--dense` K3's and Qwen 27B's with
their dense classes (attention, MLP, shared experts, latent projections, lm_head) in bf16, FP8
and int8 codes (`format CLASS fp8|int8 channel rounded`), side by side.

    ./dev bench            (or .venv/bin/python benchmarks/bench.py [--repeats N] [--tiers])
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# model -> (spec, generated module, MINI interpret script, devices it runs on)
MODELS = {
    "Qwen 3.8 27B": ("schedules/qwen3_8_27b.sched", "generated/qwen3_8_27b.py",
                     "examples/run_mini.py", 8),
    "Kimi K3": ("schedules/kimi_k3.sched", "generated/kimi_k3.py", "examples/run_k3_mini.py", 16),
}


def _py(args: list[str]) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, check=True)
    return r.stdout


def bench_mkc_compile(spec: str, repeats: int) -> list[float]:
    from mkc import compiler
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiler.compile_spec(ROOT / spec)
        times.append(time.perf_counter() - t0)
    return times


def bench_cli_compile(spec: str, repeats: int) -> list[float]:
    """Wall time of the command a user runs, interpreter start and imports included."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _py(["-m", "mkc", "compile", spec, "-o", str(ROOT / "generated")])
        times.append(time.perf_counter() - t0)
    return times


def bench_check_latency(spec: str, broken: tuple[str, str], repeats: int) -> list[float]:
    """Wall time of `mkc check` on `spec` with one edit (old, new) that makes it wrong: the
    answer must come before any stage it does not need loads (JAX above all)."""
    import re
    import tempfile
    pattern, new = broken
    text, n = re.subn(pattern, new, (ROOT / spec).read_text(), count=1, flags=re.M)
    assert n == 1, pattern
    path = Path(tempfile.mkdtemp(prefix="mkc-bench-")) / Path(spec).name
    path.write_text(text)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "mkc", "check", str(path)], cwd=ROOT,
                           capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        times.append(time.perf_counter() - t0)
        assert r.returncode == 1 and "error[" in r.stderr, r.stderr
    return times


# (what, (line pattern, replacement)): a syntax error, and an error resolve finds (a model
# config that does not exist)
BROKEN = (("syntax error", (r"^schedule ", "schedul ")),
          ("resolve error", (r'^(\s*model\s+)"[^"]*"', r'\1"no_such_model"')))


def synthetic_checkpoint(config_name: str, root: Path) -> int:
    """A full-size checkpoint of zeros for a shipped config, written as a sparse safetensors
    file (header, then a hole: no disk blocks, reads as zeros); its size in bytes."""
    import struct

    import numpy as np

    from mkc.checkpoint import _NUMPY_DTYPES, family_of
    config = json.loads((ROOT / "mkc" / "model" / "configs" / f"{config_name}.json").read_text())
    reference = family_of(config).module("reference")
    codes = {np.dtype(d): code for code, d in _NUMPY_DTYPES.items()}    # the loader's table
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, dtype) in reference.param_shapes(reference.load_config(config)).items():
        code = codes[np.dtype(dtype)]
        n = np.dtype(dtype).itemsize
        for d in shape:
            n *= d
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return offset


def bench_pack_rss(config_name: str, module: str) -> dict:
    """Peak RSS of packing rank 0 of a full-size checkpoint loaded lazily (a fresh process)."""
    import shutil
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="mkc-ckpt-"))
    try:
        size = synthetic_checkpoint(config_name, root)
        code = (f"import importlib, resource, time; from mkc.checkpoint import load_checkpoint; "
                f"gen = importlib.import_module('generated.{Path(module).stem}'); "
                f"t0 = time.perf_counter(); _, hf = load_checkpoint({str(root)!r}, lazy=True); "
                "packed = gen.pack_rank(hf, 0); s = time.perf_counter() - t0; "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "
                "sum(a.nbytes for a in packed.values()), s)")
        rss, packed, seconds = _py(["-c", code]).split()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"checkpoint": size, "rss": int(rss), "packed": int(packed), "seconds": float(seconds)}


def bench_tpu_compile(module: str, repeats: int, batch: int) -> list[float]:
    times = []
    for _ in range(repeats):   # a fresh process each time: no compile cache between runs
        out = _py(["benchmarks/tpu_compile.py", module, str(batch)])
        times.append(float(out.rsplit(" in ", 1)[1].split()[0]))
    return times


def bench_interpret(script: str, steps: int, *extra: str) -> list[float]:
    out = _py([script, "--json", "--steps", str(steps), "--batch", "1", *extra])
    summary = json.loads(next(ln for ln in out.splitlines() if ln.startswith("JSON "))[5:])
    return [s["seconds"] for s in summary["steps"][1:]]     # step 0 includes tracing


def bench_tiers() -> list[tuple[str, float, str]]:
    """Wall time of each test tier as `./dev` runs it (every core), with its last line."""
    out = []
    for tier in ("quick", "test"):
        t0 = time.perf_counter()
        r = subprocess.run(["./dev", tier], cwd=ROOT, capture_output=True, text=True)
        last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
        out.append((tier, time.perf_counter() - t0, last))
    return out


def vmem_peaks(spec: str) -> dict[int, float]:
    """VMEM peak in MiB at both ends of the spec's batch range."""
    from mkc import compiler
    from mkc.checks import vmem_budget
    c = compiler.check_spec(ROOT / spec)
    s, events = c.ir, c.events
    return {b: vmem_budget(s, events, b)[0] / 2**20 for b in (s.batch_min, s.batch_max)}


def bench_modelled() -> list[str]:
    """Modelled steps (`mkc perf`: priced by libtpu's cycles where the kernel's measure is
    shipped or cached, and `--counted`, by the work counted from the kernel mkc emits) of each
    shipped spec at batch 1 and 8 and its verify step, and, for K3 and Qwen3.5-35B-A3B, the same
    spec with its experts in each other format `bundles.EXPERT_FORMATS` names: a table."""
    import re
    import tempfile

    from bundles import EXPERT_FORMATS, format_text

    from mkc import compiler
    from mkc.perf.run import run
    lines = ["| spec | formats | batch | modelled step | modelled tok/s | % of HBM floor | copies "
             "| modelled step, counted price |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        specs = []
        for path in sorted((ROOT / "schedules").glob("*.sched")):
            specs.append(path)
            for fmt in EXPERT_FORMATS.get(path, ()):
                text = format_text(path, fmt)
                if text != path.read_text():
                    variant = Path(tmp) / fmt.replace(" ", "_") / path.name
                    variant.parent.mkdir(exist_ok=True)   # K3 and Qwen MoE share a format name
                    variant.write_text(text)
                    specs.append(variant)
        for path in specs:
            # each format line whole (a rounded one's `rounded [scale ...]` included)
            label = ", ".join(m.group(1) for m in re.finditer(r"^  format (\S+ .+?)\s*$",
                                                              path.read_text(), re.M)) or "as checkpointed"
            s = compiler.check_spec(path).ir
            rows = [(b, None) for b in (1, 8)] + ([(None, s.verify_rows)] if s.verify_rows else [])
            for batch, verify in rows:
                rep = run(s, batch, None, verify)
                what = f"verify {verify}" if verify else str(batch)
                step = f"{rep['step_seconds'] * 1e3:.2f} ms" + (
                    "" if rep["priced_by"].startswith("compiled") else " (counted: not compiled)")
                counted = run(s, batch, None, verify, compiled=False)["step_seconds"]
                lines.append(f"| `{path.name}` | {label} | {what} | {step} "
                             f"| {rep['tokens_per_s']:.0f} | {rep['percent_of_hbm_floor']:.1f} | "
                             f"{rep['copies']} | {counted * 1e3:.2f} ms |")
    return lines


def bench_dense() -> list[str]:
    """K3's and Qwen 27B's modelled steps (`mkc perf`, compiled price) at batch 1 and 8 with
    their dense classes in each format: the shipped spec (bf16) and `bundles.dense_text`'s
    variants (FP8 and int8 codes with a scale per output column, rounded; K3 also with its
    attention streamed as codes), modelled in this run under the same constants: a table."""
    from bundles import DENSE_CLASSES, DENSE_FORMATS, dense_text, dense_variants

    from mkc import compiler
    from mkc.perf.run import hbm_bytes_by_class, run
    lines = ["| spec | dense classes | format | batch | modelled step | vs bf16 | modelled tok/s "
             "| weight bytes a core | % of HBM floor | priced by |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, spec, attention in dense_variants():
        classes = ", ".join(DENSE_CLASSES[spec] + (("attention",) if attention else ()))
        base = compiler.check_spec(spec).ir
        variants = [("bf16 (shipped)", base)] + [
            (f"`{fmt} channel rounded`",
             compiler.check_source(dense_text(spec, fmt, attention), str(spec)).ir)
            for fmt in DENSE_FORMATS]
        for batch in (1, 8):
            bf16 = run(base, batch)["step_seconds"]
            for label, s in variants:
                rep = run(s, batch)
                weights = sum(v for k, v in hbm_bytes_by_class(s, batch, s.context).items()
                              if "weights" in k)
                lines.append(f"| `{spec.name}`{' (attention streamed)' if attention else ''} "
                             f"| {classes} | {label} | {batch} | {rep['step_seconds'] * 1e3:.3f} ms "
                             f"| {bf16 / rep['step_seconds']:.2f}x | {rep['tokens_per_s']:.0f} "
                             f"| {weights / 1e9:.2f} GB | {rep['percent_of_hbm_floor']:.1f} "
                             f"| {rep['priced_by'].split(':')[0]} |")
    return lines


def bench_against_hand_kernel() -> list[str]:
    """K3's shipped spec against the calibration spec (the hand-written kernel's layout and
    formats, benchmarks/data/calibration/kimi_k3.sched), both modelled in this run under the
    same constants and compiled prices, at batch 1 and 8 and the verify step of 8 rows: the
    ratio is the calibration spec's step over the shipped one's. First at the context the
    calibration spec is validated at (the published runs', `tokens_in_cache` in
    published_points.json), the published hand-kernel steps beside them; then at the shipped
    spec's own context, where no published step validates the calibration spec."""
    from mkc import compiler
    from mkc.perf.constants import DATA
    from mkc.perf.run import run
    shipped = compiler.check_spec(ROOT / "schedules" / "kimi_k3.sched").ir
    hand = compiler.check_spec(ROOT / "benchmarks" / "data" / "calibration" / "kimi_k3.sched").ir
    points = json.loads((DATA / "published_points.json").read_text())
    published = {(p["sequences"], p["batch"]) if p.get("sequences") else (p["batch"], None):
                 p["step_s"] for p in points["steps"]}
    rows = []
    for tokens in (points["tokens_in_cache"], shipped.context):
        validated = tokens == points["tokens_in_cache"]
        for batch, verify in ((1, None), (8, None), (None, 8)):
            a, b = (run(s, batch, tokens, verify)["step_seconds"] for s in (hand, shipped))
            what = f"verify {verify}" if verify else f"batch {batch}"
            rows.append((f"{what}, {tokens} tokens" + (" (validated)" if validated else ""), a, b,
                         published.get((batch or 1, verify)) if validated else None))
    return _against_hand_kernel("Kimi K3", rows)


def _against_hand_kernel(model: str, rows: list[tuple[str, float, float, float | None]]) -> list[str]:
    """The table of a model's steps (label, calibration spec's, shipped spec's, published: s)."""
    lines = [f"| {model} step | hand kernel's layout (modelled) | shipped spec (modelled) | ratio "
             "| hand kernel, published |", "| --- | --- | --- | --- | --- |"]
    for what, a, b, pub in rows:
        lines.append(f"| {what} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms | {a / b:.2f}x | "
                     + (f"{pub * 1e3:.2f} ms |" if pub else "- |"))
    return lines


def bench_muse_against_hand_kernel() -> list[str]:
    """Muse Spark's shipped spec against its calibration spec (the hand-written kernel's layout,
    benchmarks/data/calibration/muse_spark.sched, in the shipped spec's formats: NVFP4 experts
    but layers 0 and 61's bf16 as stored (`exact_edits`), bf16 dense), both modelled in this
    run as the published steps ran (`hold_out` in
    published_points.json: every row routed alike, its cached tokens, the kernel's batch-8
    edits on the calibration spec); the published hand-kernel steps beside them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import validate_perf
    from mkc import compiler
    from mkc.perf.constants import DATA
    from mkc.perf.run import model
    hold = json.loads((DATA / "published_points.json").read_text())["hold_out"]
    shipped = compiler.check_spec(ROOT / "schedules" / "muse_spark.sched").ir
    published = {p["batch"]: p["step_s"] for p in hold["steps"] if p["weights"] == "nvfp4_bf16"}
    rows = []
    for batch in (1, 8):
        hand = validate_perf.weight_set_ir(hold, "nvfp4_bf16", batch, exact=True)
        a, b = (model(s, batch, hold["tokens_in_cache"], routing=hold["routing"]).res.step_s
                for s in (hand, shipped))
        rows.append((f"batch {batch}", a, b, published[batch]))
    return _against_hand_kernel("Muse Spark", rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", choices=list(MODELS), help="one model only (default: both)")
    ap.add_argument("--tiers", action="store_true",
                    help="only time the test tiers, `./dev quick` and `./dev test` (half an hour)")
    ap.add_argument("--modelled", action="store_true",
                    help="only the modelled steps of every shipped spec (and K3 in its other expert formats)")
    ap.add_argument("--dense", action="store_true",
                    help="only K3's and Qwen 27B's modelled steps with their dense classes in "
                         "bf16, FP8 and int8 codes")
    args = ap.parse_args()
    if args.dense:
        print("Modelled, not measured (tpu7x constants as recorded; mkc perf, compiled price):")
        print("\n".join(bench_dense()))
        print("    reproduce: .venv/bin/python benchmarks/bench.py --dense")
        return 0
    if args.modelled:
        print("Modelled, not measured (tpu7x constants as recorded; mkc perf):")
        print("\n".join(bench_modelled() + [""] + bench_against_hand_kernel() + [""]
                        + bench_muse_against_hand_kernel()))
        print("    reproduce: ./dev bench --modelled")
        return 0
    if args.tiers:
        for tier, seconds, last in bench_tiers():
            print(f"./dev {tier}: {seconds / 60:.1f} min wall ({last})\n    reproduce: ./dev {tier}")
        return 0
    rows, peaks = [], {}
    for model, (spec, module, script, devices) in MODELS.items():
        if args.model and model != args.model:
            continue
        for what, edit in BROKEN:
            rows.append((f"{model}: mkc check of the spec with a {what}, CLI wall time",
                         bench_check_latency(spec, edit, args.repeats),
                         f"(edit {spec}: {edit[0]!r} -> {edit[1]!r}) .venv/bin/mkc check SPEC"))
        rows.append((f"{model}: mkc compile of the full spec, in process (parse to module text)",
                     bench_mkc_compile(spec, args.repeats),
                     f".venv/bin/python -c 'from mkc import compiler; compiler.compile_spec(\"{spec}\")'"))
        rows.append((f"{model}: mkc compile of the full spec, CLI wall time",
                     bench_cli_compile(spec, args.repeats), f".venv/bin/mkc compile {spec}"))
        for batch in (1, 8):
            rows.append((f"{model}: libtpu compile of the full-size kernel, batch {batch}",
                         bench_tpu_compile(module, max(1, args.repeats // 2), batch),
                         f".venv/bin/python benchmarks/tpu_compile.py {module} {batch}"))
        # side by side: the lean host side the runners use (mkc.interpret) and JAX's own
        for how, extra in (("lean host side", ()), ("JAX's own callbacks", ("--jax-callbacks",))):
            rows.append((f"{model}: interpret mode, MINI decode step, {devices} CPU devices, "
                         f"on_wait, batch 1, {how}", bench_interpret(script, 3, *extra),
                         f".venv/bin/python {script} --steps 3 --batch 1 {' '.join(extra)}"))
        peaks[model] = vmem_peaks(spec)
    for name, times, cmd in rows:
        print(f"{name}: median {statistics.median(times):.3f} s over {len(times)} "
              f"(min {min(times):.3f}, max {max(times):.3f})\n    reproduce: {cmd}")
    pack = bench_pack_rss("qwen3_8_27b", "generated/qwen3_8_27b.py")
    print(f"Qwen 3.8 27B: packing rank 0 of a lazily loaded full-size checkpoint "
          f"({pack['checkpoint'] / 2**30:.1f} GiB of zeros, sparse): peak RSS "
          f"{pack['rss'] / 2**30:.2f} GiB for {pack['packed'] / 2**30:.2f} GiB packed, "
          f"{pack['seconds']:.0f} s\n    reproduce: .venv/bin/python -c 'import sys; "
          "sys.path.insert(0, \"benchmarks\"); import bench; "
          "print(bench.bench_pack_rss(\"qwen3_8_27b\", \"generated/qwen3_8_27b.py\"))'")
    for model, by_batch in peaks.items():
        spec = MODELS[model][0]
        print(f"{model} VMEM peak: " + ", ".join(f"batch {b}: {mib:.2f} MiB"
                                                 for b, mib in by_batch.items())
              + f"\n    reproduce: .venv/bin/mkc check {spec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

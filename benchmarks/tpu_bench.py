"""Time the kernel mkc emits for a spec, on a TPU, and write the measured points (with chip,
topology, libtpu and JAX versions) for the `steps` of `mkc/perf/data/published_points.json`.

    .venv/bin/python benchmarks/tpu_bench.py SPEC [--model NAME] [--batch 1 8] [--verify]
        [--steps 20] [--warmup 3] [--profile DIR] [--out points.json]

On a TPU host: the decode step at each --batch (and with --verify the verify step of the
spec's R rows for one sequence) runs at full size, with random weights created on the devices
shard by shard (no host copy of the model), after --warmup steps; --steps are timed one by one
with `block_until_ready` and reported as median, min, max and interquartile spread. --profile
records a `jax.profiler` trace of the timed steps and sums its events named after mkc's op
scopes (`mkc_op:<kind>.<op>`), beside each op's modelled time.

On a host without a TPU the same code runs a MINI config in TPU interpret mode on virtual CPU
devices (`--model <family>_mini`), so every line of it is exercised, and everything it prints
and writes says it is NOT a TPU timing (`"tpu": false`): such points must never be used to
calibrate.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _version(pkg: str) -> str:
    try:
        return version(pkg)
    except PackageNotFoundError:
        return ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", help="a .sched file")
    ap.add_argument("--model", help="a shipped config name or checkpoint directory (default: the "
                                    "spec's model line); on a host without a TPU, a MINI config")
    ap.add_argument("--batch", type=int, nargs="+", help="decode batches (default: 1 and the "
                                                         "spec's largest)")
    ap.add_argument("--verify", action="store_true", help="also the verify step (R rows, 1 sequence)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per kernel (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--profile", metavar="DIR", help="record a jax.profiler trace of the timed steps")
    ap.add_argument("--out", metavar="FILE", help="write the points (JSON) here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    return args


def device_weights(module, mesh):
    """Random weights of the module's HBM shapes, made on the devices shard by shard (uniform
    bits for integer and packed formats, N(0, 0.02) for floats): timing needs their size, not
    their values."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    ranked = NamedSharding(mesh, P(module.AXIS))
    out = {}
    for n, (name, (shape, dtype)) in enumerate(sorted(module.hbm_shapes().items())):
        full = (module.RANKS, *shape)

        def make(key, full=full, dtype=dtype):
            if jnp.issubdtype(dtype, jnp.floating):
                return (0.02 * jax.random.normal(key, full, jnp.float32)).astype(dtype)
            return jax.random.bits(key, full, jnp.uint8).astype(dtype)
        out[name] = jax.jit(make, out_shardings=ranked)(jax.random.key(n))
    return out


def time_steps(step, args_of, steps: int, warmup: int) -> list[float]:
    """Seconds of each of `steps` calls after `warmup`; `args_of(out)` gives the next call's
    arguments from the previous call's output (None: the first)."""
    import jax
    out = None
    for _ in range(warmup):
        out = step(*args_of(out))
        jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        a = args_of(out)
        t0 = time.perf_counter()
        out = step(*a)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    return times


def summary(times: list[float]) -> dict:
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"step_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "iqr_s": q[2] - q[0], "steps": len(times)}


def op_times(trace_dir: str) -> dict[str, float]:
    """Seconds per op scope in a profiler trace: events named `mkc_op:<kind>.<op>` summed."""
    from mkc.runtime import scopes
    totals: dict[str, float] = {}
    for f in Path(trace_dir).rglob("*.trace.json.gz"):
        with gzip.open(f, "rt") as fh:
            events = json.load(fh).get("traceEvents", [])
        for e in events:
            name = str(e.get("name", ""))
            if name.startswith(scopes.OP + ":") and "dur" in e:
                key = name[len(scopes.OP) + 1:]
                totals[key] = totals.get(key, 0.0) + float(e["dur"]) * 1e-6
    return totals


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mkc.diagnostics import MkcError
    from mkc.serve.model import prepare_devices
    try:
        prepare_devices(args.spec)     # on a CPU host, a virtual device per rank of the spec's mesh
    except MkcError as e:
        print(e.render(Path(args.spec).read_text(errors="replace")), file=sys.stderr)
        return 2
    import jax
    import numpy as np
    from jax.experimental.pallas import tpu as pltpu

    from mkc import compiler, files

    on_tpu = jax.default_backend() == "tpu"
    label = "TPU" if on_tpu else "NOT a TPU timing: TPU interpret mode on CPU"
    try:
        c = compiler.compile_spec(args.spec, args.model)
    except MkcError as e:
        print(e.render(Path(args.spec).read_text(errors="replace")), file=sys.stderr)
        return 2
    if not on_tpu and not c.ir.model.endswith("_mini"):
        print(f"tpu_bench: no TPU here ({jax.default_backend()}): a full-size {c.ir.model} kernel "
              "cannot run in interpret mode in useful time; pass --model <family>_mini to run "
              "the same code path on CPU (not a TPU timing)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="mkc-bench-") as tmp:
        path = Path(tmp) / f"{compiler.module_name(c)}.py"
        files.write_atomically(path, c.module_source)
        module = files.import_generated(path)
    interpret = None
    if not on_tpu:
        from mkc.interpret import lean_interpreter
        lean_interpreter()             # interpret mode's host side, not the kernel, made faster
        interpret = pltpu.InterpretParams()
    mesh = module.make_mesh()
    weights = (device_weights(module, mesh) if on_tpu
               else module.place_weights(module.random_weights(), mesh))
    batches = args.batch or sorted({1, c.ir.batch_max})
    kernels = [("decode", b) for b in batches] + ([("verify", 1)] if args.verify else [])
    points = []
    prof = None
    for kernel, b in kernels:
        if kernel == "decode":
            step = module.make_decode_step(mesh, b, interpret)
            tokens = np.ones((b,), np.int32)

            def args_of(out, b=b, tokens=tokens):
                state = module.place_state(b, mesh) if out is None else out[2]   # donated
                return weights, state, tokens, np.full((b,), 7, np.int32)
        else:
            R = c.ir.verify_rows
            step = module.make_verify_step(mesh, 1, R, interpret)
            state = module.place_state(1, mesh)       # one sequence's state, spread over R rows
            caches = {n: a for n, a in state.items() if n not in module.ROW_STATES}
            states = {n: a for n, a in state.items() if n in module.ROW_STATES}

            def args_of(out, R=R, caches=caches, states=states):
                if out is not None:                      # the caches are donated
                    caches = {n: out[2][n] for n in caches}
                return weights, caches, states, np.ones((1, R), np.int32), np.full((1,), 7, np.int32)
        if args.profile:
            prof = args.profile
            jax.profiler.start_trace(prof, create_perfetto_trace=True)
        times = time_steps(step, args_of, args.steps, args.warmup)
        if args.profile:
            jax.profiler.stop_trace()
        rows = b if kernel == "decode" else c.ir.verify_rows
        point = {"kernel": kernel, "batch": b, "rows": rows, **summary(times),
                 "tokens_per_s": rows / statistics.median(times) if kernel == "decode" else None}
        points.append(point)
        print(f"{kernel} at {b} {'rows' if kernel == 'decode' else 'sequence'}: median "
              f"{point['step_s'] * 1e3:.3f} ms (min {point['min_s'] * 1e3:.3f}, max "
              f"{point['max_s'] * 1e3:.3f}, IQR {point['iqr_s'] * 1e3:.3f}) over {args.steps} "
              f"steps [{label}]", flush=True)
    ops = op_times(prof) if prof else {}
    if prof:
        print(f"profile in {prof}: " + (", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in
                                                  sorted(ops.items(), key=lambda kv: -kv[1])[:12])
                                        or "no mkc_op scopes in the trace (interpret mode and "
                                           "XLA CPU do not record the kernel's scopes)"))
    record = {"tpu": on_tpu, "note": label, "spec": str(args.spec), "model": c.ir.model,
              "chip": c.ir.chip if on_tpu else f"cpu ({c.ir.chip} kernel, interpret mode)",
              "topology": c.ir.topology, "devices": [str(d.device_kind) for d in mesh.devices.flat][:1],
              "jax": _version("jax"), "jaxlib": _version("jaxlib"), "libtpu": _version("libtpu"),
              "steps": args.steps, "warmup": args.warmup,
              "points": [{"batch": p["batch"], "step_s": p["step_s"], "tokens_per_s": p["tokens_per_s"],
                          **{k: p[k] for k in ("kernel", "rows", "min_s", "max_s", "iqr_s")}}
                         for p in points],
              "op_seconds": ops}
    if args.out:
        files.write_atomically(Path(args.out), json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out} [{label}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

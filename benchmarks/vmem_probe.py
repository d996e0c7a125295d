"""Probe what Mosaic really allocates in VMEM, one small kernel per case, compiled with libtpu
compile-only for tpu7x (no TPU needed), and compare with mkc's padding model (mkc/ir.py).

Each case is a grid-less pallas_call whose scratch buffers are each filled by one DMA from an
HBM input of the same shape (so none is optimised away), optionally with buffers inside a
`pl.run_scoped`, extra DMA semaphores, SMEM scratch, or a VMEM input/output of a given shape.
The kernel's VMEM use is read exactly from XLA's after-codegen HLO (the tpu_custom_call's
used scoped memory); a case's bytes are that minus the bare kernel's (one (8, 128) f32 output).

    .venv/bin/python benchmarks/vmem_probe.py            # run every case, ~2 s each
    .venv/bin/python benchmarks/vmem_probe.py --save     # and write benchmarks/data/vmem_probe.json
    .venv/bin/python benchmarks/vmem_probe.py --worker CASE_JSON   # (one case, in a subprocess)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DATA = ROOT / "benchmarks" / "data" / "vmem_probe.json"


def _cases() -> list[dict]:
    """name -> kernel description. "scratch"/"scoped": [shape, dtype]; "sems": DMA semaphore
    array sizes; "smem": [shape, dtype]; "vmem_in"/"vmem_out": [shape, dtype] windows."""
    cases: list[dict] = [{"name": "bare"}]

    def buf(name, shape, dtype, where="scratch"):
        cases.append({"name": name, where: [[list(shape), dtype]]})

    # Second-minor (row) padding per dtype: heights 1..32, in scratch (a kernel argument).
    for dtype in ("f32", "int32", "bf16", "u8", "int8"):
        for rows in (1, 2, 3, 4, 5, 8, 9, 12, 16, 24, 32, 40, 64):
            buf(f"{dtype}[{rows},256]", (rows, 256), dtype)
    # Lane (minor) padding.
    for dtype in ("f32", "bf16"):
        for cols in (1, 100, 128, 130, 640, 896):
            buf(f"{dtype}[16,{cols}]", (16, cols), dtype)
    # Leading dims multiply the padded tile; the batch-row buffers of the kernels.
    for b in (1, 2, 4, 8, 16):
        buf(f"recv bf16[2,8,{b},5120]", (2, 8, b, 5120), "bf16")
        buf(f"stage bf16[5,{b},1024]", (5, b, 1024), "bf16")
        buf(f"acc f32[27,{b},1280]", (27, b, 1280), "f32")
        buf(f"x f32[{b},5120]", (b, 5120), "f32")
    # 1-D arrays.
    for n in (1, 128, 200, 1024, 1500, 4096):
        buf(f"f32[{n}]", (n,), "f32")
        buf(f"bf16[{n}]", (n,), "bf16")
    # Buffers inside pl.run_scoped (memref.alloca, not kernel arguments).
    for dtype in ("f32", "bf16"):
        for rows in (1, 3, 8, 16):
            for cols in (128, 1280):
                buf(f"scoped {dtype}[{rows},{cols}]", (rows, cols), dtype, "scoped")
        buf(f"scoped {dtype}[2,3,128]", (2, 3, 128), dtype, "scoped")
        buf(f"scoped {dtype}[5,1,100]", (5, 1, 100), dtype, "scoped")
    cases.append({"name": "scoped two f32[3,8,1280] in one scope",
                  "scoped": [[[3, 8, 1280], "f32"], [[3, 8, 1280], "f32"]]})
    cases.append({"name": "two scopes in sequence, f32[3,8,1280] and f32[2,8,1280]",
                  "scoped_seq": [[[3, 8, 1280], "f32"], [[2, 8, 1280], "f32"]]})
    # Alignment between buffers: many small ones.
    cases.append({"name": "8 x f32[1,128]", "scratch": [[[1, 128], "f32"]] * 8})
    cases.append({"name": "8 x bf16[1,128]", "scratch": [[[1, 128], "bf16"]] * 8})
    cases.append({"name": "3 x f32[8,128]", "scratch": [[[8, 128], "f32"]] * 3})
    cases.append({"name": "f32[1,128]", "scratch": [[[1, 128], "f32"]]})
    cases.append({"name": "3 x f32[1,128]", "scratch": [[[1, 128], "f32"]] * 3})
    cases.append({"name": "f32[1,128] and bf16[1,128]",
                  "scratch": [[[1, 128], "f32"], [[1, 128], "bf16"]]})
    # Semaphores and SMEM.
    cases.append({"name": "DMA semaphores 1024 (sflag memory, 16 KiB: 4096 do not fit)",
                  "sems": [1024]})
    cases.append({"name": "DMA semaphores 16 x (2,8)", "sems": [[2, 8]] * 16})
    cases.append({"name": "SMEM int32[4096]", "smem": [[[4096], "int32"]]})
    # VMEM input and output windows (what XLA hands the kernel).
    for rows in (1, 2, 3, 5, 8, 16):
        cases.append({"name": f"vmem in f32[2,{rows},256]", "vmem_in": [[2, rows, 256], "f32"]})
        cases.append({"name": f"vmem out f32[27,{rows},1152]",
                      "vmem_out": [[27, rows, 1152], "f32"]})
        cases.append({"name": f"vmem out bf16[5,{rows},1024]",
                      "vmem_out": [[5, rows, 1024], "bf16"]})
    return cases


# ---- worker: compile one case ---------------------------------------------------------------
def _worker(case: dict) -> dict:
    dump = tempfile.mkdtemp(prefix="mkc_probe_dump_")
    os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    import shutil

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental import topologies
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mkc.confirm import _used_from_dump

    dt = {"bf16": jnp.bfloat16, "f32": jnp.float32, "int32": jnp.int32, "u8": jnp.uint8,
          "int8": jnp.int8}
    scratch = [(tuple(s), dt[d]) for s, d in case.get("scratch", [])]
    scoped = [(tuple(s), dt[d]) for s, d in case.get("scoped", [])]
    seq = [(tuple(s), dt[d]) for s, d in case.get("scoped_seq", [])]
    sems = case.get("sems", [])
    smem = [(tuple(s), dt[d]) for s, d in case.get("smem", [])]
    vin = case.get("vmem_in")
    vout = case.get("vmem_out")
    out_shape, out_dtype = ((tuple(vout[0]), dt[vout[1]]) if vout else ((8, 128), jnp.float32))
    # A dummy HBM input first, so every case has an argument placed on the TPU topology.
    hbm = [((8, 128), jnp.float32)] + scratch + scoped + seq
    n_hbm = len(hbm)

    def kernel(*refs):
        i = 0
        srcs = refs[i:i + n_hbm]
        i += n_hbm
        vin_ref = None
        if vin:
            vin_ref = refs[i]
            i += 1
        o_ref = refs[i]
        i += 1
        bufs = refs[i:i + len(scratch)]
        i += len(scratch)
        sem = refs[i]
        i += 1
        extra_sems = refs[i:i + len(sems)]
        i += len(sems)
        smem_refs = refs[i:i + len(smem)]
        if vout:
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        elif vin_ref is not None:
            o_ref[...] = jnp.zeros((8, 128), jnp.float32) + vin_ref[0, 0:1, 0:128]
        else:
            o_ref[...] = jnp.zeros((8, 128), jnp.float32)
        dummy, srcs = srcs[0], srcs[1:]
        for src, dst in zip(srcs, bufs):
            c = pltpu.make_async_copy(src, dst, sem)
            c.start()
            c.wait()
        for s in extra_sems:
            c = pltpu.make_async_copy(dummy, o_ref, s.at[(0,) * len(s.shape)])
            c.start()
            c.wait()
        for s in smem_refs:
            s[0] = s[1] + 1
        if scoped:
            def body(*tmp):
                for src, dst in zip(srcs[len(scratch):], tmp):
                    c = pltpu.make_async_copy(src, dst, sem)
                    c.start()
                    c.wait()
            pl.run_scoped(body, *[pltpu.VMEM(s, d) for s, d in scoped])
        for k, (s, d) in enumerate(seq):
            def body(tmp, k=k):
                c = pltpu.make_async_copy(srcs[len(scratch) + len(scoped) + k], tmp, sem)
                c.start()
                c.wait()
            pl.run_scoped(body, pltpu.VMEM(s, d))

    sem_shapes = [pltpu.SemaphoreType.DMA(tuple(s) if isinstance(s, list) else (s,))
                  for s in sems]
    in_specs = [pl.BlockSpec(memory_space=pl.ANY)] * n_hbm
    args_shapes = list(hbm)
    if vin:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.VMEM))
        args_shapes.append((tuple(vin[0]), dt[vin[1]]))
    call = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype), in_specs=in_specs,
        out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
        scratch_shapes=[pltpu.VMEM(s, d) for s, d in scratch] + [pltpu.SemaphoreType.DMA(())]
        + sem_shapes + [pltpu.SMEM(s, d) for s, d in smem],
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=64 * 2**20))
    topo = topologies.get_topology_desc("tpu7x=2x2x1", platform="tpu")
    mesh = Mesh(np.array(topo.devices[:1]), ("x",))
    sh = NamedSharding(mesh, P())
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in args_shapes]
    try:
        with jax.set_mesh(mesh):     # some lowerings ask the mesh's device kind
            jax.jit(call).lower(*args).compile()
        used, _ = _used_from_dump(dump)
        return {"used_bytes": used}
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)[:400]}
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def run_case(case: dict, timeout: float = 120.0) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               TF_CPP_MIN_LOG_LEVEL="3")
    try:
        p = subprocess.run([sys.executable, __file__, "--worker", json.dumps(case)],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("PROBE "):
            return json.loads(line[6:])
    return {"error": p.stderr[-400:]}


def modelled(case: dict) -> int:
    """mkc's model of the case's bytes beyond the bare kernel."""
    from mkc import ir
    n = sum(ir.padded_bytes(tuple(s), d) for s, d in case.get("scratch", []))
    n += sum(ir.padded_bytes(tuple(s), d, scoped=True) for s, d in case.get("scoped", []))
    n += max((ir.padded_bytes(tuple(s), d, scoped=True) for s, d in case.get("scoped_seq", [])),
             default=0)
    if case.get("vmem_in"):
        n += ir.window_bytes(tuple(case["vmem_in"][0]), case["vmem_in"][1])
    if case.get("vmem_out"):
        n += ir.window_bytes(tuple(case["vmem_out"][0]), case["vmem_out"][1]) - 4096
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--only", help="run cases whose name contains this")
    a = ap.parse_args()
    if a.worker:
        print("PROBE " + json.dumps(_worker(json.loads(a.worker))), flush=True)
        return 0
    cases = [c for c in _cases() if not a.only or a.only in c["name"] or c["name"] == "bare"]
    t0 = time.perf_counter()
    results, base = [], None
    wrong = 0
    print(f"{'case':<48} {'libtpu':>10} {'mkc':>10}")
    for c in cases:
        r = run_case(c)
        if c["name"] == "bare":
            base = r.get("used_bytes")
        got = None if "error" in r or base is None else r["used_bytes"] - base
        model = modelled(c)
        wrong += got is not None and got != model
        results.append({"case": c, "libtpu_bytes": got, "mkc_bytes": model,
                        "error": r.get("error", "")})
        shown = "error" if got is None else str(got)
        print(f"{c['name']:<48} {shown:>10} {model:>10}{'' if got == model else '  <-'}",
              flush=True)
    secs = time.perf_counter() - t0
    print(f"{len(cases)} cases in {secs:.0f} s; bare kernel {base} B; "
          f"{wrong} differ from mkc's model")
    if a.save:
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(json.dumps({"chip": "tpu7x", "bare_bytes": base, "seconds": round(secs),
                                    "command": "benchmarks/vmem_probe.py --save",
                                    "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

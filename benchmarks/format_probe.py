"""Which routed-expert weight formats each TPU generation compiles, measured with libtpu
(compile-only, no TPU): one small Pallas kernel per format runs the expert formats' own
expert-matmul body (`mkc.layers.expert_formats.ops`) on one pack group and is compiled for a
one-chip slice of each generation.

    .venv/bin/python benchmarks/format_probe.py [GENERATION ...]    # default: every one
    .venv/bin/python benchmarks/format_probe.py --bundles tpu7x v6e v5e
    .venv/bin/python benchmarks/format_probe.py --dense [--bundles] [GENERATION ...]

With --dense it probes the dense classes' codes instead (`format CLASS fp8|int8 channel
rounded`, `mkc.layers.dense_formats`): one ring tile's dot as `mkc.runtime.ring.codes_dot`
makes it (8 rows through a tile of 1024 input rows and 768 columns, codes two rows a bf16 slot
row, the column scales after them) in bf16 (the shipped format), FP8 codes fed as they are,
FP8 converted to bf16 first (what a generation without FP8 operands runs) and int8 (a mixed
bf16 x int8 dot); and, for comparison, int8 converted to bf16 in the kernel.

Prints one line per generation and format: "compiles" or the compiler's first error line.
With --bundles, each compile also dumps libtpu's final instruction bundles (LLO) and the line
gives the kernel's scheduled bundles and its FP8/FP4 unpack instructions on the codes: what
the format costs in the code libtpu makes of mkc's expert matmul (a static schedule, not a
timing; 8 rows of one 512-row pack group, 256 columns). FP4 compiles on tpu7x only: the
generations without it are refused by the spec check (`mkc.target.Generation.fp4_operand`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # libtpu's lockfile, no TPU here
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GROUP, COLS, ROWS = 512, 256, 8


def _kernel(fmt: str, fp8_operand: bool):
    import jax.numpy as jnp

    from mkc.layers.expert_formats import ops
    F32, BF16 = jnp.float32, jnp.bfloat16

    def kernel(x_ref, codes_ref, scales_ref, o_ref):
        x, codes, scales = x_ref[...], codes_ref[...], scales_ref[...]
        if fmt in SCALE_VARIANTS:               # a pack group's block scale read as a float
            scale = scales[:1].astype(F32)
            if fmt.startswith(FP4):
                o_ref[...] = ops.fp4_group_matmul(x, codes, scale)
            else:
                o_ref[...] = ops.fp8_group_matmul(x, codes, scale, fp8_operand)
        elif fmt == "mxfp4":
            w = ops.mxfp4_dequantize_tile(codes, ops.mxfp4_scale_bias(scales), BF16)
            o_ref[...] = jnp.dot(x, w, preferred_element_type=F32)
        elif fmt == "fp8":
            w = ops.fp8_block_scaled_tile(codes, scales, BF16)
            o_ref[...] = jnp.dot(x, w, preferred_element_type=F32)
        elif fmt == FP4:        # e2m1 codes, two a byte, fed as they are (one scale a group)
            o_ref[...] = ops.fp4_group_matmul(x, codes, ops.e8m0_scale(scales[:1]))
        else:                   # fp8 with a scale per pack group: codes fed where the MXU takes them
            o_ref[...] = ops.fp8_group_matmul(x, codes, ops.e8m0_scale(scales[:1]),
                                              fp8_operand or fmt == "fp8 codes")
    return kernel


# ---- the dense classes' ring tiles (--dense) ------------------------------------------------
TILE_ROWS, TILE_COLS = 1024, 768
DENSE = ("bf16", "fp8 codes", "fp8 converted", "int8 codes", "int8 converted")


def _dense_kernel(fmt: str):
    import jax.numpy as jnp

    from mkc.runtime.ring import codes_dot
    F32 = jnp.float32

    def kernel(x_ref, w_ref, o_ref):
        x = x_ref[...]
        if fmt == "bf16":
            o_ref[...] = jnp.dot(x, w_ref[...], preferred_element_type=F32)
            return
        codes = fmt.split()[0]
        packed, scale = w_ref[:TILE_ROWS // 2, :], w_ref[TILE_ROWS // 2:TILE_ROWS // 2 + 1, :]
        if fmt == "int8 converted":       # not the kernel's: the codes converted here first
            from jax.experimental.pallas import tpu as pltpu
            w = pltpu.bitcast(packed, jnp.int8).astype(jnp.bfloat16)
            part = jnp.dot(x, w, preferred_element_type=F32)
        else:
            part = codes_dot(x, packed, codes, fmt != "fp8 converted")
        o_ref[...] = part * scale.astype(F32)
    return kernel


def probe_dense(generation: str, fmt: str) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental import topologies
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mkc import ir, target
    gen = target.generation(generation)
    topo = topologies.get_topology_desc(f"{gen.prefix}={'x'.join(['1'] * gen.ndims)}",
                                        platform="tpu")
    rows = TILE_ROWS if fmt == "bf16" else ir.ring_tile_shape(TILE_ROWS, TILE_COLS, "int8", True)[0]
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(_dense_kernel(fmt), out_shape=jax.ShapeDtypeStruct((ROWS, TILE_COLS),
                                                                            jnp.float32),
                          in_specs=[vmem] * 2, out_specs=vmem,
                          name="probe_" + fmt.replace(" ", "_"))
    one = NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), P())
    args = [jax.ShapeDtypeStruct((ROWS, TILE_ROWS), jnp.bfloat16, sharding=one),
            jax.ShapeDtypeStruct((rows, TILE_COLS), jnp.bfloat16, sharding=one)]
    try:
        jax.jit(call).lower(*args).compile()
        return "compiles"
    except Exception as e:                              # the compiler's verdict is the result
        return "fails: " + (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def probe(generation: str, fmt: str) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental import topologies
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mkc import target
    gen = target.generation(generation)
    topo = topologies.get_topology_desc(f"{gen.prefix}={'x'.join(['1'] * gen.ndims)}",
                                        platform="tpu")
    code_rows = GROUP // 2 if fmt == "mxfp4" or fmt.startswith(FP4) else GROUP
    # E8M0 bytes a 32-row block; a float block scale a pack group, in one whole sublane tile
    scale_dtype, scale_rows = {"f32": (jnp.float32, 8), "bf16": (jnp.bfloat16, 16)}.get(
        SCALE_VARIANTS.get(fmt, ""), (jnp.uint8, GROUP // 32))
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(_kernel(fmt, gen.fp8_operand),
                          out_shape=jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
                          in_specs=[vmem] * 3, out_specs=vmem,
                          name="probe_" + fmt.replace(" ", "_"))
    one = NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), P())
    args = [jax.ShapeDtypeStruct((ROWS, GROUP), jnp.bfloat16, sharding=one),
            jax.ShapeDtypeStruct((code_rows, COLS), jnp.uint8, sharding=one),
            jax.ShapeDtypeStruct((scale_rows, COLS), scale_dtype, sharding=one)]
    try:
        jax.jit(call).lower(*args).compile()
        return "compiles"
    except Exception as e:                              # the compiler's verdict is the result
        return "fails: " + (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


FORMATS = ("mxfp4", "fp8", "fp8 block")
# Not a format: the codes fed to a mixed bf16 x fp8 dot whatever the generation, which must
# compile exactly where `mkc.target.Generation.fp8_operand` says the MXU takes FP8 operands.
CODES = "fp8 codes"
# FP4 e2m1 codes with a scale per pack group (`format CLASS fp4 block N`), which must compile
# exactly where `mkc.target.Generation.fp4_operand` says the MXU takes FP4 operands (tpu7x;
# v6e and older: "Bad lhs/rhs type ... f4E2M1FN").
FP4 = "fp4 block"
# The block formats with their scale stored as a float rather than E8M0 (benchmarks/block_scales.py
# compares them): the variant's name -> the scale's dtype.
SCALE_VARIANTS = {f"{f} {t} scale": t for f in ("fp8 block", FP4) for t in ("bf16", "f32")}


# libtpu's dumps of one compile: Mosaic's passes, and the final LLO with its bundle schedule
_DUMP_FLAGS = "--xla_mosaic_dump_to={0}/mosaic --xla_jf_dump_to={0}/jf --xla_jf_dump_llo_text=true"


def bundles(generation: str, fmt: str, script: str = __file__) -> str:
    """`probe` in a fresh process that dumps libtpu's LLO: its verdict, the scheduled bundles
    of the kernel and how many unpack (FP8/FP4 -> wider) instructions the bundles hold
    (`script`: a probe whose `--one GENERATION CASE` compiles one case, named probe_*)."""
    import re
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mkc-llo-") as d:
        env = dict(os.environ, LIBTPU_INIT_ARGS=_DUMP_FLAGS.format(d), TF_CPP_MIN_LOG_LEVEL="3")
        r = subprocess.run([sys.executable, script, "--one", generation, fmt], env=env,
                           capture_output=True, text=True, timeout=600)
        verdict = (r.stdout.strip().splitlines() or [f"fails: exit {r.returncode}"])[-1]
        schedule = [f for f in Path(d, "jf").glob("*schedule-analysis_final_bundles.txt")
                    if "probe_" in f.name]
        final = [f for f in Path(d, "jf").glob("*final_bundles.txt")
                 if "probe_" in f.name and "schedule-analysis" not in f.name]
        if verdict != "compiles" or not schedule or not final:
            return verdict if verdict != "compiles" else "compiles (no LLO dump found)"
        total = re.search(r"total scheduled bundles:\s+(\d+)", schedule[0].read_text())
        unpacks = len(re.findall(r"\bvunpack\S*", final[0].read_text()))
        return f"{total.group(1) if total else '?'} bundles, {unpacks} unpack instructions"


def main(argv: list[str]) -> int:
    from mkc import target
    if argv[:1] == ["--one"]:                           # bundles' child: one compile
        print((probe_dense if argv[2] in DENSE else probe)(argv[1], argv[2]))
        return 0
    dense = "--dense" in argv
    argv = [a for a in argv if a != "--dense"]
    counted = argv[:1] == ["--bundles"]
    generations = argv[counted:] or sorted(target.known_chips())
    if dense:
        return main_dense(generations, counted)
    failed = False
    for g in generations:
        for fmt in (*FORMATS, CODES, FP4):
            verdict = bundles(g, fmt) if counted else probe(g, fmt)
            compiles = verdict.startswith("compiles") or "bundles" in verdict
            gen = target.generation(g)
            expected = {CODES: gen.fp8_operand, FP4: gen.fp4_operand}.get(fmt, True)
            failed |= compiles != expected
            print(f"{g} {fmt}: {verdict}" + ("" if compiles == expected else
                                              f" (expected {'to compile' if expected else 'to fail'})"))
    return 1 if failed else 0


def main_dense(generations: list[str], counted: bool) -> int:
    """The dense classes' tile dot in each format on each generation: FP8 codes fed as they are
    compile exactly where `Generation.fp8_operand` says; every other variant everywhere."""
    from mkc import target
    failed = False
    for g in generations:
        for fmt in DENSE:
            verdict = bundles(g, fmt) if counted else probe_dense(g, fmt)
            compiles = verdict.startswith("compiles") or "bundles" in verdict
            expected = target.generation(g).fp8_operand if fmt == "fp8 codes" else True
            failed |= compiles != expected
            print(f"{g} {fmt}: {verdict}" + ("" if compiles == expected else
                                              f" (expected {'to compile' if expected else 'to fail'})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Which routed-expert weight formats each TPU generation compiles, measured with libtpu
(compile-only, no TPU): one small Pallas kernel per format runs the K3 lowering's own
expert-matmul body (`mkc.families.kimi_k3.ops`) on one pack group and is compiled for a
one-chip slice of each generation.

    .venv/bin/python benchmarks/format_probe.py [GENERATION ...]    # default: every one

Prints one line per generation and format: "compiles" or the compiler's first error line.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # libtpu's lockfile, no TPU here
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GROUP, COLS, ROWS = 512, 256, 8


def _kernel(fmt: str):
    import jax.numpy as jnp

    from mkc.families.kimi_k3 import ops
    F32, BF16 = jnp.float32, jnp.bfloat16

    def kernel(x_ref, codes_ref, scales_ref, o_ref):
        x, codes, scales = x_ref[...], codes_ref[...], scales_ref[...]
        if fmt == "mxfp4":
            w = ops.mxfp4_dequantize_tile(codes, scales, BF16)
            o_ref[...] = jnp.dot(x, w, preferred_element_type=F32)
        elif fmt == "fp8":
            w = ops.fp8_block_scaled_tile(codes, scales, BF16)
            o_ref[...] = jnp.dot(x, w, preferred_element_type=F32)
        else:                                           # fp8 with a scale per pack group
            o_ref[...] = ops.fp8_group_matmul(x, codes, scales[:1])
    return kernel


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
    code_rows = GROUP // 2 if fmt == "mxfp4" else GROUP
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(_kernel(fmt), out_shape=jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
                          in_specs=[vmem] * 3, out_specs=vmem)
    one = NamedSharding(Mesh(np.array(topo.devices[:1]), ("x",)), P())
    args = [jax.ShapeDtypeStruct((ROWS, GROUP), jnp.bfloat16, sharding=one),
            jax.ShapeDtypeStruct((code_rows, COLS), jnp.uint8, sharding=one),
            jax.ShapeDtypeStruct((GROUP // 32, COLS), jnp.uint8, sharding=one)]
    try:
        jax.jit(call).lower(*args).compile()
        return "compiles"
    except Exception as e:                              # the compiler's verdict is the result
        return "fails: " + (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


FORMATS = ("mxfp4", "fp8", "fp8 block")


def main(argv: list[str]) -> int:
    from mkc import target
    generations = argv or sorted(target.known_chips())
    failed = False
    for g in generations:
        for fmt in FORMATS:
            verdict = probe(g, fmt)
            failed |= verdict != "compiles"
            print(f"{g} {fmt}: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

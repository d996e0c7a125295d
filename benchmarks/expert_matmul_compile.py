"""The routed experts' lowered matmul (`mkc.layers.expert_formats.lowering.expert_matmul`) in
the `int4 block 128` and `nvfp4` formats compiled with libtpu (compile-only, no TPU) for a
one-chip slice, at Muse Spark's per-rank expert shapes (tp 8: gate|up 4096 input rows x 2 x 512
columns in pack groups of 512, down 512 x 4096 in groups of 128), and, for comparison, one
512-row pack group of 256 columns in each formulation the formats could take:

* int4: the kernel's (a bf16 dot of the codes' integers per 128-row block, each partial product
  times its scales) and one dot of a block-diagonal input (every row repeated once per block,
  masked to it; the 4 partial products a row summed after their scales);
* nvfp4: the kernel's (values decoded to bf16, e2m1 x e4m3, one dot a pack group) and the
  e2m1 codes fed to the MXU as they are, one dot per 16-row block or one dot of a
  block-diagonal input (32 blocks).

    .venv/bin/python benchmarks/expert_matmul_compile.py [--bundles] [GENERATION ...]

Prints one line per case: "compiles" or the compiler's first error line; with --bundles, the
scheduled bundles of the kernel from libtpu's LLO dump (a static schedule, not a timing) and
its unpack instructions. Exits 1 where a verdict differs from mkc's: int4 compiles on every
generation, nvfp4 exactly where `mkc.target.Generation.fp4_operand` (its decode converts
Mosaic f4E2M1FN vectors, which older generations lack). The slot's reads return the arrays
the kernel is given; the rest is the lowering's own code.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # libtpu's lockfile, no TPU here
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "layers"))

# (format, input rows, columns, pack group, batch rows)
MUSE = [(f, k, n, g, b) for f in ("int4", "nvfp4") for k, n, g in ((4096, 1024, 512), (512, 4096, 128))
        for b in (1, 8)]
GROUP, COLS = 512, 256
VARIANTS = ("int4 kernel", "int4 block-diagonal", "nvfp4 kernel", "nvfp4 codes per 16 rows",
            "nvfp4 codes block-diagonal")


def _fmt(name: str):
    from mkc.ir import WeightFormat
    return WeightFormat(name, 128, rounded=True) if name == "int4" else WeightFormat(name, 16)


def _block_diagonal(x, block: int):
    """x [B, G] -> [B * G/block, G] bf16: row b * nb + j is x's row b masked to block j."""
    import jax.numpy as jnp
    from jax import lax
    rows, width = x.shape
    nb = width // block
    r = lax.broadcasted_iota(jnp.int32, (nb, width), 0)
    c = lax.broadcasted_iota(jnp.int32, (nb, width), 1) // block
    xf = x.astype(jnp.float32)
    return jnp.concatenate([jnp.where(r == c, jnp.broadcast_to(xf[b:b + 1], (nb, width)), 0.0)
                            for b in range(rows)], axis=0).astype(jnp.bfloat16)


def _variant_body(variant: str, rows: int):
    """One pack group in a formulation the kernel does not take (`VARIANTS`)."""
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental.pallas import tpu as pltpu
    F32 = jnp.float32

    def body(x_ref, codes_ref, scales_ref, o_ref):
        x = x_ref[...]
        if variant == "int4 block-diagonal":
            s = scales_ref[:GROUP // 128].astype(F32)                   # a stand-in [4, N] scale
            w = pltpu.bitcast(codes_ref[...], jnp.int4).astype(jnp.bfloat16)
            res, nb = jnp.dot(_block_diagonal(x, 128), w, preferred_element_type=F32), GROUP // 128
        else:
            s = lax.bitcast_convert_type(scales_ref[:GROUP // 16], jnp.float8_e4m3fn).astype(F32)
            nb = GROUP // 16
            if variant == "nvfp4 codes per 16 rows":
                out = None
                for b in range(nb):
                    w = pltpu.bitcast(codes_ref[b * 8:(b + 1) * 8], jnp.float4_e2m1fn)
                    part = jnp.dot(x[:, b * 16:(b + 1) * 16], w, preferred_element_type=F32) * s[b:b + 1]
                    out = part if out is None else out + part
                o_ref[...] = out
                return
            w = pltpu.bitcast(codes_ref[...], jnp.float4_e2m1fn)
            res = jnp.dot(_block_diagonal(x, 16), w, preferred_element_type=F32)
        o_ref[...] = jnp.concatenate([jnp.sum(res[b * nb:(b + 1) * nb] * s, axis=0, keepdims=True)
                                      for b in range(rows)], axis=0)
    return body


def probe(generation: str, case: str) -> str:
    """Compile one case ("int4 4096 1024 512 8": the lowering; a `VARIANTS` name and rows: one
    pack group) for a one-chip slice of `generation`: "compiles" or the error's first line."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl
    from jax.experimental import topologies
    from jax.experimental.pallas import tpu as pltpu
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from layer_bodies import expert_matmul_body
    from mkc import target
    from mkc.layers import expert_formats
    *name, rows = case.rsplit(" ", 1)[0], int(case.rsplit(" ", 1)[1])
    name = name[0]
    if name in VARIANTS:
        fmt_name, k, n, group = name.split()[0], GROUP, COLS, GROUP
    else:
        fmt_name, k, n, group = name.split()[0], *(int(v) for v in name.split()[1:])
    t = expert_formats.tensors("m", k, n, _fmt(fmt_name))
    codes, scales = t["m_codes"].shape, t["m_scales"].shape
    body = (_variant_body(name, rows) if name in VARIANTS and name.split()[1] != "kernel"
            else expert_matmul_body(_fmt(fmt_name), codes, group))
    gen = target.generation(generation)
    topo = topologies.get_topology_desc(f"{gen.prefix}={'x'.join(['1'] * gen.ndims)}", platform="tpu")
    mesh = Mesh(np.array(topo.devices[:1]), ("x",))
    one = NamedSharding(mesh, P())
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
                          in_specs=[vmem] * 3, out_specs=vmem, name="probe_" + fmt_name)
    args = [jax.ShapeDtypeStruct((rows, k), jnp.bfloat16, sharding=one),
            jax.ShapeDtypeStruct(codes, jnp.uint8, sharding=one),
            jax.ShapeDtypeStruct(scales, jnp.uint8, sharding=one)]
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):     # Mosaic asks the target
            jax.jit(call).lower(*args).compile()
        return "compiles"
    except Exception as e:                              # the compiler's verdict is the result
        return "fails: " + (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def cases() -> list[str]:
    return ([f"{f} {k} {n} {g} {b}" for f, k, n, g, b in MUSE]
            + [f"{v} {b}" for v in VARIANTS for b in (1, 8)])


def main(argv: list[str]) -> int:
    import format_probe

    from mkc import target
    if argv[:1] == ["--one"]:                           # a bundles child: one compile
        print(probe(argv[1], argv[2]))
        return 0
    counted = argv[:1] == ["--bundles"]
    failed = False
    for g in argv[counted:] or sorted(target.known_chips()):
        for case in cases():
            verdict = (format_probe.bundles(g, case, script=__file__) if counted else probe(g, case))
            compiles = verdict.startswith("compiles") or "bundles" in verdict
            expected = target.generation(g).fp4_operand if "nvfp4" in case else True
            failed |= compiles != expected
            print(f"{g} {case}: {verdict}" + ("" if compiles == expected else
                                               f" (expected {'to compile' if expected else 'to fail'})"),
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

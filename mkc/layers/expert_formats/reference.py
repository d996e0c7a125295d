"""The expert formats in the reference's rounding emulation: how the kernel's dots take an
expert matrix (`mkc.reference.rounding.Rounding.linear`'s operands)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.layers.expert_formats import feeds_codes
from mkc.reference.rounding import Rounding


def expert_operands(rounding: Rounding, matrix: str) -> str | None:
    """How the kernel's dots take expert matrix `matrix` (`gate_up`, `down`) in the spec's
    format: FP8 codes fed as they are (`feeds_codes`) or FP4 codes (always fed as they are) in
    a mixed dot, else bf16 values (int4's integers and nvfp4's decoded values too: bf16 dots,
    `int4_linear`, `nvfp4_linear`). FP8 requantized from bf16 and FP4's values are the
    requantized ones: the caller passes the checkpoint as the kernel holds it (the generated
    module's `requantized_weights`)."""
    fmt = rounding.weight_format(f"expert.{matrix}")
    if fmt is not None and fmt.name == "fp4":
        return "mixed_fp4"
    if fmt is not None and fmt.name in ("int4", "nvfp4"):
        return "bf16"
    return "mixed_fp8" if fmt is not None and feeds_codes(fmt) else None


def int4_linear(rounding: Rounding, x: jax.Array, codes: jax.Array, scales: jax.Array, block: int,
                group: int) -> jax.Array:
    """``x @ (codes x scales).T`` as the kernel multiplies an `int4 block N` matrix
    (`lowering._int4_matmul`): `codes` the int4 integers ``[out, in]``, `scales` their bf16
    values ``[out, in / block]``; one bf16 dot per step of min(block, `group`) inputs, each
    partial product times its block's scales, added in order."""
    step = min(block, group)
    steps = [r // block for r in range(0, codes.shape[1], step)]
    per_step = jnp.asarray(scales, jnp.float32)[:, jnp.asarray(steps)].T         # [steps, out]
    return rounding.linear(x, jnp.asarray(codes, jnp.float32), step, "bf16", per_step)


def nvfp4_linear(rounding: Rounding, x: jax.Array, values: jax.Array, global_scale: jax.Array,
                 group: int) -> jax.Array:
    """``x @ (values x global).T`` as the kernel multiplies an `nvfp4` matrix
    (`lowering._nvfp4_matmul`): `values` e2m1 x e4m3 ``[out, in]`` (bf16 values, exact),
    `global_scale` f32 per output row; one bf16 dot per pack group of `group` inputs, added in
    order, the sum times the global scales."""
    return rounding.linear(x, values, group, "bf16") * jnp.asarray(global_scale, jnp.float32)[None, :]

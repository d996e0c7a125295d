"""The expert formats in the reference's rounding emulation: how the kernel's dots take an
expert matrix (`mkc.reference.rounding.Rounding.linear`'s operands)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mkc.layers.expert_formats import feeds_codes
from mkc.reference.rounding import Rounding, chunked_linear


def expert_operands(rounding: Rounding, matrix: str, kind: str | None = None) -> str | None:
    """How the kernel's dots take expert matrix `matrix` (`gate_up`, `down`) in the spec's
    format: FP8 codes fed as they are (`feeds_codes`) or FP4 codes (always fed as they are) in
    a mixed dot, else bf16 values (int4's integers and nvfp4's decoded values too: bf16 dots,
    `int4_linear`, `nvfp4_linear`). FP8 requantized from bf16 and FP4's values are the
    requantized ones: the caller passes the checkpoint as the kernel holds it (the generated
    module's `requantized_weights`)."""
    fmt = rounding.weight_format(f"expert.{matrix}", kind)
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


def nvfp4_linear(rounding: Rounding, x: jax.Array, codes, scales, group: int) -> jax.Array:
    """``x @ W`` as the kernel multiplies an `nvfp4` matrix (`lowering._nvfp4_matmul`), W held
    as its slot holds it (`codes`, `scales`: ``weights.pack_nvfp4_for_kernel``'s): one product
    per pack group of `group` inputs, added in order, the sum times the global scales. Each
    group's product: a bf16 dot of the decoded values (e2m1 x e4m3, exact); at up to
    `NVFP4_CODES_ROWS` rows the kernel's block-diagonal dot of the codes
    (`ops.nvfp4_codes_matmul`, run jitted as it is)."""
    from mkc.layers.expert_formats import NVFP4_BLOCK, NVFP4_CODES_ROWS, weights
    codes, scales = np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)
    _, _, glob = weights.unpack_nvfp4_from_kernel(codes, scales)
    x = rounding.mm_in(x)
    if x.size // x.shape[-1] <= NVFP4_CODES_ROWS:
        flat = x.reshape(-1, x.shape[-1])
        blocks = x.shape[-1] // NVFP4_BLOCK
        out = _codes_linear(flat, jnp.asarray(codes), jnp.asarray(scales[:blocks]), group)
        return (out * jnp.asarray(glob)[None, :]).reshape(*x.shape[:-1], -1)
    values = weights.nvfp4_dequantize(codes, scales) / glob.astype(np.float64)[None, :]   # exact
    w = jnp.asarray(values.T, jnp.float32)
    return chunked_linear(x, w, group, "bf16") * jnp.asarray(glob)[None, :]


@functools.partial(jax.jit, static_argnums=(3,))     # pltpu.bitcast lowers; it does not run eagerly
def _codes_linear(x: jax.Array, codes: jax.Array, scales: jax.Array, group: int) -> jax.Array:
    from mkc.layers.expert_formats import NVFP4_BLOCK, ops
    out = None
    for r in range(0, x.shape[-1], group):
        part = ops.nvfp4_codes_matmul(x[:, r:r + group].astype(jnp.bfloat16),
                                      codes[r // 2:(r + group) // 2],
                                      scales[r // NVFP4_BLOCK:(r + group) // NVFP4_BLOCK])
        out = part if out is None else out + part
    return out


def nvfp4_unit_values(codes: jax.Array, block_scales: jax.Array) -> jax.Array:
    """An NVFP4 checkpoint's codes ``[..., out, in/2]`` (input 2j in the low nibble) and e4m3
    block scales ``[..., out, in/16]`` (any dtype holding their values: the reference's f32)
    -> e2m1 x e4m3, f32 ``[..., out, in]``: exact (6 significant bits at most). The global
    scale multiplies a product of them, as the kernel multiplies it (`lowering._nvfp4_matmul`),
    so a product is of the exact values."""
    from mkc.layers.expert_formats import NVFP4_BLOCK
    from mkc.model.mxfp4 import E2M1_VALUES
    codes = jnp.asarray(codes).astype(jnp.uint8)
    nibbles = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    values = jnp.asarray(E2M1_VALUES)[nibbles.astype(jnp.int32)]
    return values * jnp.repeat(jnp.asarray(block_scales, jnp.float32), NVFP4_BLOCK, axis=-1)

"""GPT-OSS compute pieces over in-kernel values, for the family's compute bodies
(``mkc.families.gpt_oss.lowering``): f32 on 2-D values ([rows, lanes]) with only ops Mosaic
lowers (no ``lax.top_k``, no gathers, no lane reshapes), plus the host-side tables and numpy
packers they read.

The math is upstream transformers' ``models/gpt_oss/modeling_gpt_oss.py``, as the package
docstring cites it, in the shapes a kernel computes it in: YaRN's rotary table. As for the other
families, the reference (``mkc.families.gpt_oss.reference``) is the oracle the kernel is judged
against and shares no code with it; ``tests/families/gpt_oss/test_gpt_oss_ops.py`` checks
each piece, and the lowered bodies that combine them (a window's ring masked by the positions
its slots hold, the routed experts), against an independent numpy derivation of upstream's
expression.

Attention (with its sinks and the sliding window's mask), the RMS norm (GptOssRMSNorm, a plain
weight), the RoPE rotation (pair ``(i, i + D/2)``, over whole heads) and the MoE (top-k routing
as weights over every expert lane, the clamped SwiGLU on the kernel's ``[gate | up]`` halves)
are the layer library's (``mkc.layers.gqa``, ``mkc.layers.moe``, ``mkc.layers.ops``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mkc.families.gpt_oss.config import GptOssDims
from mkc.layers.ops import rms_norm  # noqa: F401

F32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# Norm and rotary embedding


def yarn_inv_freq(d: GptOssDims) -> np.ndarray:
    """The ``D/2`` rotary frequencies (``_compute_yarn_parameters``): ``theta^(-2i/D)`` blended
    with it divided by the YaRN factor, by a ramp over pair indices ``yarn_low .. yarn_high``
    (1 where the interpolated frequency is taken). In f64, rounded once to f32."""
    i = np.arange(d.head_dim // 2, dtype=np.float64)
    extrapolated = d.rope_theta ** (-2.0 * i / d.head_dim)
    high = d.yarn_high + (0.001 if d.yarn_high == d.yarn_low else 0.0)   # upstream's guard
    interpolated_share = np.clip((i - d.yarn_low) / (high - d.yarn_low), 0.0, 1.0)
    return (extrapolated * (1 - interpolated_share)
            + extrapolated / d.yarn_factor * interpolated_share).astype(np.float32)


def rope_table(d: GptOssDims, positions: jax.Array) -> jax.Array:
    """The host-computed ``rope`` input: cos and sin ``[2, B, D]`` at each row's position, the
    ``D/2`` angles repeated over both halves (``apply_rope``'s layout), times the YaRN
    attention factor (upstream scales cos and sin, so q and k each carry it)."""
    angles = positions.astype(F32)[:, None] * jnp.asarray(yarn_inv_freq(d))[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.stack([jnp.cos(angles), jnp.sin(angles)]) * d.yarn_attention_factor


# ---------------------------------------------------------------------------------------------
# Host-side packing of the checkpoint's interleaved gate|up


def deinterleave_gate_up(rows: np.ndarray, half: int) -> np.ndarray:
    """The checkpoint's gate|up along axis 0 (``[2I, ...]``: gate at even indices, up at odd,
    upstream's ``gate_up[..., ::2]`` and ``[..., 1::2]``) -> ``[2 * half, ...]``: the gate rows,
    zeros up to ``half``, the up rows, zeros up to ``2 * half``. Works on any trailing axes (a
    weight's MXFP4 codes or scales, a bias), so packing moves bytes and rounds nothing."""
    rows = np.asarray(rows)
    width = rows.shape[0] // 2
    if rows.shape[0] % 2 or half < width:
        raise ValueError(f"{rows.shape[0]} gate|up rows do not make two halves of at most {half}")
    pad = [(0, half - width)] + [(0, 0)] * (rows.ndim - 1)
    return np.concatenate([np.pad(rows[0::2], pad), np.pad(rows[1::2], pad)], axis=0)

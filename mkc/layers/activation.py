"""The activation of a gated MLP (`SwiGLU`, `MoE`'s experts) as an option that owns its math:
the kernel's (`kernel`) and the reference's (`reference`). Declared without jax; a computing
method imports the jax module that holds its math when it is called (by name, as
`Sublayer.module` does: checking a spec imports none)."""
from __future__ import annotations

import enum
import importlib
from typing import Any


class Activation(enum.Enum):
    """A gated MLP's activation of its `[gate | up]` product (a routed or shared expert's, a
    dense MLP's)."""

    SILU = "silu"               # silu(gate) * up
    # GPT-OSS's: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
    # the model's swiglu_alpha and swiglu_limit
    CLAMPED = "clamped"
    # Kimi K3's SiTU: beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta), the
    # model's activation_situ_beta and activation_situ_linear_beta
    SITU = "situ"

    def kernel(self, c: Any, gate_up: Any, width: int) -> Any:
        """In the kernel, on a `[gate | up]` product of halves `width` lanes wide."""
        ops = importlib.import_module("mkc.layers.ops")
        if self is Activation.CLAMPED:
            return ops.clamped_swiglu_halves(gate_up, width, c.dims.swiglu_alpha, c.dims.swiglu_limit)
        if self is Activation.SITU:
            d = c.dims
            return ops.situ_packed(gate_up, width, d.activation_situ_beta, d.activation_situ_linear_beta)
        return ops.swiglu(gate_up, width)

    def reference(self, d: Any, gate: Any, up: Any, kernel: bool = False) -> Any:
        """In the reference, on the gate and up products; `kernel`: in the kernel's one
        jitted expression (XLA's f32 order depends on it)."""
        reference = importlib.import_module("mkc.layers.moe.reference")
        if self is Activation.CLAMPED:
            fn = reference.kernel_clamped_swiglu if kernel else reference.clamped_swiglu
            return fn(gate, up, d.swiglu_alpha, d.swiglu_limit)
        if self is Activation.SITU:
            ops = importlib.import_module("mkc.layers.ops")
            return ops.situ(gate, up, d.activation_situ_beta, d.activation_situ_linear_beta)
        return reference.silu_glu(gate, up)

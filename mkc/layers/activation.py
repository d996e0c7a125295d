"""The activation of a gated MLP (`SwiGLU`, `MoE`'s experts) as an option. Declared without jax
(checking a spec imports none): its math is one entry, by member, in a table of each jax
module, the kernel's `mkc.layers.ops.ACTIVATIONS` and the reference's
`mkc.layers.reference.ACTIVATIONS`; a new activation is one member here and one entry in each."""
from __future__ import annotations

import enum


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

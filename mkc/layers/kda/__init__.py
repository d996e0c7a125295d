"""Kimi Delta Attention (`KDA`, Kimi Linear's and Kimi K3's linear attention): a low-rank
decay gate `gate_up(gate_down(h))`; one `[q | k | v | g | b]` projection; a causal depthwise
conv with SiLU over `[q | k | v]` carried in a bf16 conv state; per head the delta rule on a
recurrent state `[Dk, Dv]` with a decay per key channel, `a = gate_lower_bound *
sigmoid(exp(A_log) * (gate + dt_bias))` (q and k L2-normalised, `beta = sigmoid(b)`); the
output norm gated by `sigmoid(g)` (the full-rank output gate) and the output projection (a
partial sum over the heads' ranks). With `residual` its own plain pre-norm and residual add;
without, the composing family's (K3's block attention residuals).

The dims a model gives it: hidden_size, rms_norm_eps, kda_num_heads, kda_head_dim (the key
and value head width, and the decay gate's rank), conv_kernel_size, gate_lower_bound. Heads
split over the `heads` shard class; the decay gate's down projection is whole on every rank.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.sublayer import Part, Sublayer
from mkc.model.graph import Op, Tensor, lane_pad, split


def projection_cols(d: Any, heads: int) -> int:
    """The projection's columns on a rank of `heads` heads: q, k, v and g head by head, then
    b padded to a lane tile."""
    return 4 * heads * d.kda_head_dim + lane_pad(heads)


@dataclass(frozen=True)
class KDA(Sublayer):
    package = "mkc.layers.kda"

    residual: bool = True          # its own pre-norm and residual add (else the family's)
    prefix: str = "self_attn."     # its parameters' names under a layer's

    def op_names(self) -> tuple[str, ...]:
        return (*(("input_norm",) if self.residual else ()), "gate_down", "gate_up", "projection",
                "conv", "delta_rule", "gated_norm", "o_proj",
                *(("attn_residual",) if self.residual else ()))

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        """Matrices first (K3's vector block puts its mix vectors after them), then vectors and
        the states."""
        H, hd, taps = d.hidden_size, d.kda_head_dim, d.conv_kernel_size
        heads = split(d.kda_num_heads, ways["heads"], "kda_num_heads", "heads")
        width = heads * hd
        matrix = functools.partial(Tensor, role="matrix", dtype="bf16", format_class="attention")
        vector = functools.partial(Tensor, role="vector", dtype="f32")
        ops = (
            *((Op("input_norm", reads=("x", "input_norm"), writes=("h",)),) if self.residual else ()),
            Op("gate_down", reads=("h",), writes=("gate_low",), matmul="gate_down"),
            Op("gate_up", reads=("gate_low",), writes=("gate",), matmul="gate_up"),
            Op("projection", reads=("h",), writes=("proj",), matmul="projection"),
            Op("conv", reads=("proj", "conv_weight", "conv"), writes=("qkv", "conv")),
            Op("delta_rule", reads=("qkv", "gate", "proj", "a_log", "dt_bias", "recurrent"),
               writes=("core", "recurrent")),
            Op("gated_norm", reads=("core", "proj", "o_norm"), writes=("core",)),
            Op("o_proj", reads=("core",), writes=("attn_out",), matmul="o_proj"),
            *((Op("attn_residual", reads=("attn_out", "x"), writes=("x",)),) if self.residual else ()),
        )
        tensors = {
            "gate_down": matrix("gate_down", shape=(H, hd)),                 # replicated
            "gate_up": matrix("gate_up", shape=(hd, width)),
            "projection": matrix("projection", shape=(H, projection_cols(d, heads))),
            "o_proj": matrix("o_proj", shape=(width, H), partial_out=("heads",)),
            **({"input_norm": vector("input_norm", shape=(H,))} if self.residual else {}),
            "conv_weight": vector("conv_weight", shape=(taps, 3 * width)),
            "a_log": vector("a_log", shape=(width,)),        # per head, over its key channels
            "dt_bias": vector("dt_bias", shape=(width,)),
            "o_norm": vector("o_norm", shape=(hd,)),
            "conv": Tensor("conv", "state", (taps - 1, 3 * width), "bf16", lead_dims=1),
            "recurrent": Tensor("recurrent", "state", (heads, hd, hd), "f32"),
        }
        return Part(ops, tensors, {"heads": heads, "kda_cols": projection_cols(d, heads)})

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
from mkc.model.family import ConfigError, config_float, config_int
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


def read_linear_attn_config(raw: Mapping, layers: int) -> tuple[list[str], dict[str, Any]]:
    """Kimi Linear's `linear_attn_config`: each layer's attention ("kda", or "mla" for the
    full-attention layers) from `kda_layers` and `full_attn_layers` (1-based, a partition of
    the layers), and the KDA dims (`num_heads` defaults to `num_attention_heads`). ConfigError
    for what the kind does not compute (a low-rank output gate) or a list that is no partition."""
    lin = raw["linear_attn_config"]
    if not lin.get("use_full_rank_gate", False):
        raise ConfigError("only the full-rank KDA output gate (use_full_rank_gate) is supported",
                          "set linear_attn_config.use_full_rank_gate to true, as K3 does")
    full, kda = list(lin["full_attn_layers"]), list(lin["kda_layers"])
    if not all(type(i) is int for i in full + kda):
        raise ConfigError("full_attn_layers and kda_layers must list 1-based layer numbers",
                          "as upstream Kimi configs do, e.g. [4, 8, ...]")
    if not full or set(range(1, layers + 1)) <= set(full):
        raise ConfigError(f"it has no {'mla' if not full else 'kda'} layer; the K3 lowering runs both "
                          "KDA and MLA layers", "list some but not all layers in full_attn_layers")
    twice = sorted(set(full) & set(kda))
    if twice or len(set(full)) != len(full) or len(set(kda)) != len(kda):
        raise ConfigError(f"layers listed twice in full_attn_layers / kda_layers: {twice or 'repeats'}",
                          "list each layer once, in one of the two")
    listed, wanted = set(full) | set(kda), set(range(1, layers + 1))
    if listed != wanted:
        raise ConfigError(f"full_attn_layers / kda_layers (1-based) must cover 1..{layers}: in neither "
                          f"{sorted(wanted - listed)}, out of range {sorted(listed - wanted)}",
                          "list every layer once, in one of the two")
    key = "linear_attn_config."
    fields = {"kda_num_heads": lin.get("num_heads", raw["num_attention_heads"]),
              "kda_head_dim": config_int(lin["head_dim"], key + "head_dim"),
              "conv_kernel_size": config_int(lin["short_conv_kernel_size"], key + "short_conv_kernel_size"),
              "gate_lower_bound": config_float(lin["gate_lower_bound"], key + "gate_lower_bound")}
    return ["mla" if i + 1 in set(full) else "kda" for i in range(layers)], fields

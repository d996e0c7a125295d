"""The gated delta net (`GatedDeltaNet`, Qwen3.5's linear attention): pre-norm, one
`[q | k | v | z | b | a]` projection, a causal depthwise conv with SiLU over `[q | k | v]`
carried in a conv state, the gated delta rule on a recurrent state per value head (q and k
L2-normalised), a per-head RMS norm gated by SiLU(z), the output projection (a partial sum over
the heads' ranks) and the residual add. Dims: the model's `linear_*` keys, `rms_norm_eps`
(`GatedDeltaNetDims`); reading a hybrid's config: `mkc.layers.gated_delta_net.config`."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.gqa import GQADims
from mkc.layers.sublayer import Part, Sublayer
from mkc.model.graph import Op, Tensor, lane_pad, split


@dataclass(frozen=True)
class GatedDeltaNetDims(GQADims):
    """The dims of a hybrid decoder of gated delta net and GQA layers (`GQADims`: the decoder
    and its attention); a family's subclass adds its MLPs'. Names follow the upstream config
    keys."""

    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @property
    def linear_conv_dim(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)


@dataclass(frozen=True)
class GatedDeltaNet(Sublayer):
    package = "mkc.layers.gated_delta_net"

    norm: str = "zero_centred"     # the input norm's weight
    prefix: str = "linear_attn."

    def op_names(self) -> tuple[str, ...]:
        return ("input_norm", "in_proj", "conv", "delta_rule", "gated_norm", "out_proj", "attn_residual")

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        H = d.hidden_size
        nk = split(d.linear_num_key_heads, ways["heads"], "linear_num_key_heads", "heads")
        nv = split(d.linear_num_value_heads, ways["heads"], "linear_num_value_heads", "heads")
        dk, dv = d.linear_key_head_dim, d.linear_value_head_dim
        conv_ch = 2 * nk * dk + nv * dv
        ops = (
            Op("input_norm", reads=("x", "input_norm"), writes=("h",)),
            Op("in_proj", reads=("h",), writes=("proj",), matmul="in_proj"),
            Op("conv", reads=("proj", "conv_weight", "conv"), writes=("qkv", "conv")),
            Op("delta_rule", reads=("qkv", "proj", "A_log", "dt_bias", "recurrent"),
               writes=("core", "recurrent")),
            Op("gated_norm", reads=("core", "proj", "norm"), writes=("core",)),
            Op("out_proj", reads=("core",), writes=("attn_out",), matmul="out_proj"),
            Op("attn_residual", reads=("attn_out", "x"), writes=("x",)),
        )
        tensors = {
            # Columns [q | k | v | z | b | a]; b and a each padded to a lane tile so every
            # section starts on a 128-lane boundary in the kernel.
            "in_proj": Tensor("in_proj", "matrix", (H, conv_ch + nv * dv + 2 * lane_pad(nv)), "bf16",
                              format_class="attention"),
            "out_proj": Tensor("out_proj", "matrix", (nv * dv, H), "bf16", partial_out=("heads",),
                               format_class="attention"),
            "conv_weight": Tensor("conv_weight", "vector", (d.linear_conv_kernel_dim, conv_ch), "f32"),
            "A_log": Tensor("A_log", "vector", (nv,), "f32"),
            "dt_bias": Tensor("dt_bias", "vector", (nv,), "f32"),
            "norm": Tensor("norm", "vector", (dv,), "f32"),
            "conv": Tensor("conv", "state", (d.linear_conv_kernel_dim - 1, conv_ch), "f32", lead_dims=1),
            "recurrent": Tensor("recurrent", "state", (nv, dk, dv), "f32"),
            "input_norm": Tensor("input_norm", "vector", (H,), "f32"),
        }
        return Part(ops, tensors, {
            "nk": nk, "nv": nv, "dk": dk, "dv": dv, "conv_ch": conv_ch,
            # lane offsets of in_proj's b and a sections ([q | k | v | z | b | a])
            "b_off": conv_ch + nv * dv, "a_off": conv_ch + nv * dv + lane_pad(nv)})

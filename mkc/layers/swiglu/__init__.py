"""A dense SwiGLU MLP (`SwiGLU`): pre-norm, `[gate | up]` in one matmul, `silu(gate) * up`
(or another gated activation: `activation`, Kimi K3's SiTU), the down projection (a partial
sum over the `mlp` ranks), and the residual add (without `residual`, the composing family's).
Its width is the model's `intermediate_size` split over the `mlp` shard class (`padded`: each
rank's share rounded up to whole 128-lane tiles, the last ranks' zero padded)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.activation import Activation
from mkc.layers.sublayer import Part, Sublayer
from mkc.model.graph import Op, Tensor, lane_pad, split


@dataclass(frozen=True)
class SwiGLU(Sublayer):
    package = "mkc.layers.swiglu"

    norm: str = "plain"            # the post-attention norm's weight: plain `w` or `1 + w`
    prefix: str = "mlp."
    activation: Activation = Activation.SILU
    residual: bool = True          # its own pre-norm and residual add (else the family's)
    padded: bool = False           # the width split into whole lane tiles, zero padded

    def op_names(self) -> tuple[str, ...]:
        return (*(("post_norm",) if self.residual else ()), "gate_up", "down",
                *(("mlp_residual",) if self.residual else ()))

    def width(self, d: Any, ways: Mapping[str, int]) -> int:
        """A rank's share of the MLP's width."""
        if self.padded:
            return lane_pad(-(-d.intermediate_size // ways["mlp"]))
        return split(d.intermediate_size, ways["mlp"], "intermediate_size", "mlp")

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        H = d.hidden_size
        inter = self.width(d, ways)
        ops = (
            *((Op("post_norm", reads=("x", "post_norm"), writes=("h",)),) if self.residual else ()),
            Op("gate_up", reads=("h",), writes=("act",), matmul="gate_up"),
            Op("down", reads=("act",), writes=("mlp_out",), matmul="down"),
            *((Op("mlp_residual", reads=("mlp_out", "x"), writes=("x",)),) if self.residual else ()),
        )
        tensors = {
            "gate_up": Tensor("gate_up", "matrix", (H, 2 * inter), "bf16", format_class="mlp"),
            "down": Tensor("down", "matrix", (inter, H), "bf16", partial_out=("mlp",),
                           format_class="mlp"),
            **({"post_norm": Tensor("post_norm", "vector", (H,), "f32")} if self.residual else {}),
        }
        return Part(ops, tensors, {"inter": inter})

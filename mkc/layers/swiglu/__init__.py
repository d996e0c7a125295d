"""A dense SwiGLU MLP (`SwiGLU`): pre-norm, `[gate | up]` in one matmul, `silu(gate) * up`,
the down projection (a partial sum over the `mlp` ranks), and the residual add. Its width is
the model's `intermediate_size` split over the `mlp` shard class."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.sublayer import Part, Sublayer
from mkc.model.graph import Op, Tensor, split


@dataclass(frozen=True)
class SwiGLU(Sublayer):
    package = "mkc.layers.swiglu"

    norm: str = "plain"            # the post-attention norm's weight: plain `w` or `1 + w`
    prefix: str = "mlp."

    def op_names(self) -> tuple[str, ...]:
        return ("post_norm", "gate_up", "down", "mlp_residual")

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        H = d.hidden_size
        inter = split(d.intermediate_size, ways["mlp"], "intermediate_size", "mlp")
        ops = (
            Op("post_norm", reads=("x", "post_norm"), writes=("h",)),
            Op("gate_up", reads=("h",), writes=("act",), matmul="gate_up"),
            Op("down", reads=("act",), writes=("mlp_out",), matmul="down"),
            Op("mlp_residual", reads=("mlp_out", "x"), writes=("x",)),
        )
        tensors = {
            "gate_up": Tensor("gate_up", "matrix", (H, 2 * inter), "bf16", format_class="mlp"),
            "down": Tensor("down", "matrix", (inter, H), "bf16", partial_out=("mlp",),
                           format_class="mlp"),
            "post_norm": Tensor("post_norm", "vector", (H,), "f32"),
        }
        return Part(ops, tensors, {"inter": inter})

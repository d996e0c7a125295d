"""Block attention residuals (Kimi K3's Block AttnRes), a residual strategy of the composition:
the residual stream is a list of sources in VMEM (`blocks`): the token embedding, the sum of
each completed block of `attn_res_block_size` model layers, and the block being filled. A
sublayer's input is a learned softmax mixture of them (`BlockMix`: score_i = proj .
rms(v_i, norm), then the sublayer's own norm), and its output is added to the open block
(`BlockAdd`), around a library kind configured `residual=False` (whose plain pre-norm and
residual add these replace). The model's final norm reads the mixture over every block too
(`mkc.layers.block_residuals.lowering.final_hidden`).

A composition puts `BlockMix(place)` first and `BlockAdd(place, outputs)` last in a layer kind
(`place`: "attn" or "mlp", one model layer running as two loop layers, its attention then its
MLP); `outputs` are the values the inner kind leaves to add, each cut to the hidden size.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.sublayer import Part, Sublayer
from mkc.model.graph import Op, Tensor

# the norm after each place's mixture (upstream's input_layernorm, post_attention_layernorm)
NORMS = {"attn": "input_norm", "mlp": "post_norm"}
MIX_OPS = {"attn": "input_mix", "mlp": "mlp_mix"}
ADD_OPS = {"attn": "attn_residual", "mlp": "mlp_residual"}


def _vector(name: str, width: int) -> Tensor:
    return Tensor(name, "vector", (width,), "f32")


def mix_vectors(H: int, prefix: str) -> dict[str, Tensor]:
    """One attention-residual query: its norm weight and its [1, H] projection."""
    return {f"{prefix}_res_norm": _vector(f"{prefix}_res_norm", H),
            f"{prefix}_res_proj": _vector(f"{prefix}_res_proj", H)}


@dataclass(frozen=True)
class BlockMix(Sublayer):
    """The input of the sublayer at `place`: the mixture of the blocks, then its norm (`h`)."""

    package = "mkc.layers.block_residuals"
    place: str = "attn"

    def op_names(self) -> tuple[str, ...]:
        return (MIX_OPS[self.place],)

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        H, norm = d.hidden_size, NORMS[self.place]
        query = tuple(mix_vectors(H, self.place))
        op = Op(MIX_OPS[self.place], reads=("blocks", *query, norm), writes=("h",))
        return Part((op,), {**mix_vectors(H, self.place), norm: _vector(norm, H)}, {})


@dataclass(frozen=True)
class BlockAdd(Sublayer):
    """The sublayer's `outputs` (their first hidden-size columns, summed) added to the open
    block."""

    package = "mkc.layers.block_residuals"
    place: str = "attn"
    outputs: tuple[str, ...] = ("attn_out",)

    def op_names(self) -> tuple[str, ...]:
        return (ADD_OPS[self.place],)

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        return Part((Op(ADD_OPS[self.place], reads=(*self.outputs, "blocks"), writes=("blocks",)),), {}, {})


def slots(d: Any) -> int:
    """Source slots of the block buffer: the embedding, every completed block and the one being
    filled."""
    return 2 + -(-d.num_hidden_layers // d.attn_res_block_size)


def activations(d: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """The VMEM sources (-1: the batch), `slots` of them."""
    return {"blocks": ((slots(d), -1, d.hidden_size), "f32")}


def head_vectors() -> tuple[str, ...]:
    """The model's final vectors this strategy reads after the final norm's: the output
    mixture's query."""
    return ("output_res_norm", "output_res_proj")

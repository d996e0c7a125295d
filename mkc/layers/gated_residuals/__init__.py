"""Gated norm-preserving residuals (Muse Spark's, transformers 5.25 `MuseSparkTextDecoderLayer`
with `MuseSparkResidualGate`), a residual strategy of the composition: the residual stream x
(f32) starts as the token embedding under a weightless RMS norm (`MuseSparkTextNormedEmbedding`,
eps `rms_norm_eps`); each place ("attn", "mlp") of a layer is

    h = x * rsqrt(mean(x^2) + rms_norm_eps) * (1 + w)          centred pre-norm (`GatedPre`)
    y = the kind's output (a library kind configured `residual=False`)
    n = post_norm(y)                                            (`GatedAdd`)
    u = gate / residual_gate_temperature, beta = sigmoid(u),
    alpha = sqrt(max(sigmoid(-u) * (1 + beta), 1e-3)),  x = alpha * x + beta * n

with per-channel f32 gates `post_{attention,feedforward}_residual_gate.gate [H]`. The post norm
after attention is weightless (`post_attention_layernorm`, eps `post_norm_eps`); after the MLP it
is input-scaled (`post_feedforward_layernorm`): `t = y * (1 + w)`, rounded to bf16 as upstream's
bf16 model rounds it (`type_as`) before the norm, then `t * rsqrt(mean(t^2) + post_norm_eps)`.

A composition puts `GatedPre(place)` first and `GatedAdd(place, outputs)` last around the kind
(`outputs`: the values the kind leaves, summed after each is cut to the hidden size). The dims
a model gives it: hidden_size, rms_norm_eps, post_norm_eps, residual_gate_temperature. Around
the layer loop the family's lowering imports `prologue` (the embedding's norm) from
`mkc.layers.gated_residuals.lowering`; its reference takes `reference.GATED_RESIDUALS`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.sublayer import Part, Sublayer
from mkc.model.graph import Op, Tensor

PLACES = ("attn", "mlp")
# each place's pre-norm op (the op name a residual kind's own pre-norm has) and its weight
PRE_OPS = {"attn": "input_norm", "mlp": "pre_ffn_norm"}
PRE_NORMS = {"attn": "input_norm", "mlp": "pre_ffn_norm"}
ADD_OPS = {"attn": "attn_residual", "mlp": "mlp_residual"}
GATES = {"attn": "attn_gate", "mlp": "mlp_gate"}
# the input-scaled post norm's weight (the post-attention norm has none)
POST_NORMS = {"mlp": "post_ffn_norm"}
RESIDUAL_GATE_EPS = 1e-3   # MuseSparkResidualGate's default, the floor under alpha^2
# their upstream names under a layer's prefix
PRE_NORM_WEIGHTS = {"attn": "input_layernorm.weight", "mlp": "pre_feedforward_layernorm.weight"}
GATE_PARAMS = {"attn": "post_attention_residual_gate.gate", "mlp": "post_feedforward_residual_gate.gate"}
POST_NORM_WEIGHTS = {"mlp": "post_feedforward_layernorm.weight"}


def _vector(name: str, width: int) -> Tensor:
    return Tensor(name, "vector", (width,), "f32")


def _checked(place: str) -> None:
    if place not in PLACES:
        raise ValueError(f"gated residuals: place {place!r} is not one of {PLACES}")


@dataclass(frozen=True)
class GatedPre(Sublayer):
    """The centred pre-norm of the stream at `place`: the kind's input `h`."""

    package = "mkc.layers.gated_residuals"
    place: str = "attn"

    def __post_init__(self) -> None:
        _checked(self.place)

    def op_names(self) -> tuple[str, ...]:
        return (PRE_OPS[self.place],)

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        norm = PRE_NORMS[self.place]
        op = Op(PRE_OPS[self.place], reads=("x", norm), writes=("h",))
        return Part((op,), {norm: _vector(norm, d.hidden_size)}, {})


@dataclass(frozen=True)
class GatedAdd(Sublayer):
    """The post norm of the kind's `outputs` (their first hidden-size columns, summed) and the
    gated residual update of the stream at `place`."""

    package = "mkc.layers.gated_residuals"
    place: str = "attn"
    outputs: tuple[str, ...] = ("attn_out",)

    def __post_init__(self) -> None:
        _checked(self.place)

    @property
    def vectors(self) -> tuple[str, ...]:
        """Its vectors: the gate, then the post norm's weight where it has one."""
        return (GATES[self.place], *((POST_NORMS[self.place],) if self.place in POST_NORMS else ()))

    def op_names(self) -> tuple[str, ...]:
        return (ADD_OPS[self.place],)

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        op = Op(ADD_OPS[self.place], reads=(*self.outputs, *self.vectors, "x"), writes=("x",))
        return Part((op,), {n: _vector(n, d.hidden_size) for n in self.vectors}, {})

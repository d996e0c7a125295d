"""Gated norm-preserving residuals' reference (`mkc.layers.gated_residuals`), after transformers
5.25 `MuseSparkTextDecoderLayer`: the stream starts as the embedding under a weightless RMS norm
(`MuseSparkTextNormedEmbedding`); at each place a centred pre-norm (``x * (mean(x^2) +
eps)^-0.5 * (1 + w)``, `MuseSparkTextCenteredRMSNorm`) is the kind's input, and its output's post
norm (weightless `MuseSparkRMSNorm` after attention; `MuseSparkTextInputScaledRMSNorm` after the
MLP: ``t = y * (1 + w)``, then ``t * (mean(t^2) + eps)^-0.5``) enters the stream through
`MuseSparkResidualGate`: ``u = gate / T``, ``beta = sigmoid(u)``, ``alpha = sqrt(max(sigmoid(-u)
* (1 + beta), 1e-3))``, ``x = alpha * x + beta * normed``.

The f32 oracle is upstream's math in f32. With a `Rounding`, the kernel's: the input-scaled
value rounded to bf16 (upstream's bf16 model rounds it there, `type_as`), each update jitted
whole in the kernel's formulation. Upstream names under a layer: `input_layernorm`,
`post_attention_residual_gate.gate`, `pre_feedforward_layernorm`, `post_feedforward_layernorm`,
`post_feedforward_residual_gate.gate` (the gates f32 [H], the norms bf16 [H]).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.layers.gated_residuals import (GATE_PARAMS, POST_NORM_WEIGHTS, PRE_NORM_WEIGHTS, RESIDUAL_GATE_EPS,
                                        GatedAdd, GatedPre)
from mkc.layers.reference import input_scaled_norm, rms_norm_weightless, rms_norm_zero_centred
from mkc.reference.rounding import Rounding

# random gates: u = gate / T ~ N(0, 1) at T = 0.3, so alpha (~0.6-0.95) and beta (~0.2-0.8)
# both weigh the update
GATE_STD = 0.3


@dataclasses.dataclass(frozen=True)
class GatedStream:
    """The residual stream ``x [B, H]``, and between a `GatedPre` and its `GatedAdd` the kind's
    normed input ``h`` and its ``out``."""

    x: jax.Array
    h: jax.Array | None = None
    out: jax.Array | None = None

    def leave(self, out: jax.Array) -> GatedStream:
        """The stream with a residual-less kind's output, for its `GatedAdd`."""
        return dataclasses.replace(self, out=out)


def residual_gate(residual: jax.Array, hidden: jax.Array, gate: jax.Array, temperature: float) -> jax.Array:
    """`MuseSparkResidualGate.forward` in f32."""
    w = gate / temperature
    beta = jax.nn.sigmoid(w)
    alpha = jnp.sqrt(jnp.maximum(jax.nn.sigmoid(-w) * (1.0 + beta), RESIDUAL_GATE_EPS))
    return alpha * residual + beta * hidden


# The rounding emulation of one update, jitted whole as the kernel's body is compiled whole.
@functools.partial(jax.jit, static_argnames=("eps", "temperature"))
def _kernel_update(x: jax.Array, y: jax.Array, gate: jax.Array, w: jax.Array | None, *, eps: float,
                   temperature: float) -> jax.Array:
    normed = rms_norm_weightless(y, eps) if w is None else input_scaled_norm(y, w, eps, True)
    return residual_gate(x, normed, gate, temperature)


def update(x: jax.Array, y: jax.Array, gate: jax.Array, w: jax.Array | None, d: Any,
           rounding: Rounding | None) -> jax.Array:
    """The stream ``x`` after a place's output ``y`` (``w``: the input-scaled post norm's weight,
    None for the weightless one)."""
    eps, temperature = d.post_norm_eps, d.residual_gate_temperature
    if rounding is not None:
        return _kernel_update(x, y, gate.reshape(1, -1), None if w is None else w.reshape(1, -1),
                              eps=eps, temperature=temperature)
    normed = rms_norm_weightless(y, eps) if w is None else input_scaled_norm(y, w, eps, False)
    return residual_gate(x, normed, gate, temperature)


class GatedResiduals:
    """The residual strategy of `mkc.layers.decode.DecoderReference`: the stream starts as the
    embedding's weightless RMS norm; the final norm reads it as it is."""

    def start(self, embedding: jax.Array, d: Any = None) -> GatedStream:
        return GatedStream(rms_norm_weightless(embedding, d.rms_norm_eps))

    def finish(self, params: Mapping[str, Any], d: Any, stream: GatedStream, rounding: Rounding | None
               ) -> jax.Array:
        return stream.x

    def global_shapes(self, d: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        return {}

    def residual_scale(self, d: Any) -> float:
        """Every output is normed before it enters the stream: no depth scaling."""
        return 1.0


GATED_RESIDUALS = GatedResiduals()


def forward(s: GatedPre | GatedAdd, lp: Mapping[str, jax.Array], d: Any, x: GatedStream, cache: dict,
            layer: int, positions: jax.Array, rounding: Rounding | None, kind: str) -> GatedStream:
    """`GatedPre`: the centred pre-norm of the stream is the kind's input. `GatedAdd`: the kind's
    output, post-normed, gated into the stream."""
    if isinstance(s, GatedPre):
        return dataclasses.replace(x, h=rms_norm_zero_centred(x.x, lp[PRE_NORM_WEIGHTS[s.place]],
                                                              d.rms_norm_eps))
    post = POST_NORM_WEIGHTS.get(s.place)
    return GatedStream(update(x.x, x.out, lp[GATE_PARAMS[s.place]], None if post is None else lp[post], d,
                              rounding))


def param_shapes(s: GatedPre | GatedAdd, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """A `GatedPre`'s norm weight; a `GatedAdd`'s post norm weight (after the MLP) and gate (f32),
    in upstream's module order."""
    H = (d.hidden_size,)
    if isinstance(s, GatedPre):
        return {prefix + PRE_NORM_WEIGHTS[s.place]: (H, "bfloat16")}
    post = {prefix + POST_NORM_WEIGHTS[s.place]: (H, "bfloat16")} if s.place in POST_NORM_WEIGHTS else {}
    return post | {prefix + GATE_PARAMS[s.place]: (H, "float32")}


def init_weight(s: GatedPre | GatedAdd, name: str, shape: tuple[int, ...], rng: np.random.Generator,
                residual_scale: float) -> np.ndarray:
    """Zero-centred norm weights N(0, 0.1) (gains about 1); gates N(0, 0.3)."""
    return rng.normal(0.0, GATE_STD if name.endswith(".gate") else 0.1, shape)


def init_cache(s: GatedPre | GatedAdd, d: Any, layer: int, batch: int, context: int, dtype: Any = None
               ) -> dict[str, jax.Array]:
    return {}

"""Grouped-query attention (`GQA`): pre-norm, one `[q | gate? | k | v]` projection, rotary
embedding (with a per-head RMS norm of q and k first, as an option; none on a NoPE kind), the new
key and value written to the KV cache, an online softmax over the cached tokens by KV-head group,
an optional sigmoid output gate, the output projection (a partial sum over the heads' ranks),
and the residual add (without `residual`, the pre-norm and the add are the composing family's:
Muse Spark's gated residuals, `mkc.layers.gated_residuals`).

Variants are options of the one kind: Llama 3 is `GQA()`, Qwen3.5's gated attention
`GQA(norm="zero_centred", qk_norm="zero_centred", output_gate="q_proj")`, Qwen3-MoE's
`GQA(qk_norm="plain")`, GPT-OSS's `GQA(bias=True, o_bias=True, sinks=True)` and on its
sliding layers `sliding=True`; a Qwen2-style attention with q/k/v biases and none on o_proj is
`GQA(bias=True)`. Muse Spark's (transformers 5.25 `MuseSparkTextAttention`) is
`GQA(norm="zero_centred", qk_norm="weightless", output_gate="rms_gate_proj")`, with
`sliding=True` on its sliding layers and `rope=False` on its full ones (`layer_rope_theta` 0:
`MuseSparkTextModel.forward` passes those layers no position embeddings), its dims giving
`qk_scale_factor` (`softmax_scale`). The dims a model gives it: hidden_size,
num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, `sliding_window` for a sliding
kind, `qk_scale_factor` where the scores are scaled by more than 1/sqrt(head_dim), and its rotary
embedding's (`mkc.layers.rope`; `rotary_dim`, the rotated dims of a head). Heads split over the
`heads` shard class; a part holds its KV heads, or one replica of the KV head its query heads
share when there are fewer KV heads than parts.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.sublayer import Part, Sublayer
from mkc.model.contracts import Dims
from mkc.model.graph import ContextLimit, Op, Tensor, split

QK_NORMS = ("", "plain", "zero_centred", "weightless")
# How the attention output is gated before o_proj: "" not; "q_proj": Qwen3.5's, the gate packed
# in q_proj's rows per head `[query | gate]`, `out * sigmoid(gate)`; "rms_gate_proj": Muse
# Spark's, the gate a separate `gate_proj` of the normed input, `rms(out) * sigmoid(gate)` per
# head (a parameter-free RMS norm of eps `rms_norm_eps`: `MuseSparkTextAttention.o_norm`).
OUTPUT_GATES = ("", "q_proj", "rms_gate_proj")


@dataclass(frozen=True)
class GQADims(Dims):
    """The dims of a decoder whose attention is a GQA kind with plain rotary embedding of
    `rotary_dim` dims a head at `rope_theta`; a family's subclass adds its other layers'.
    `layer_kinds`: one per iteration of the layer loop."""

    rms_norm_eps: float
    layer_kinds: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float


@dataclass(frozen=True)
class ScaledRopeGQADims(GQADims):
    """GQADims with the rope scalings `mkc.layers.rope.read_rope` reads (default or llama3)."""

    rope_type: str
    rope_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_position: int


@dataclass(frozen=True)
class GQA(Sublayer):
    package = "mkc.layers.gqa"

    norm: str = "plain"            # the input norm's weight: plain `w` or zero-centred `1 + w`
    qk_norm: str = ""              # "": none; else a per-head RMS norm of q and k of that weight
                                   # ("weightless": none, `MuseSparkRMSNorm(with_scale=False)`)
    rope: bool = True              # rotate q and k (False: NoPE, no position embedding)
    output_gate: str = ""          # one of OUTPUT_GATES
    bias: bool = False             # q/k/v biases added to the projection
    o_bias: bool = False           # o_proj's bias, added once after its reduce
    sinks: bool = False            # a learned logit per query head joins the softmax's denominator
    sliding: bool = False          # attends to the last `sliding_window` positions only
    prefix: str = "self_attn."     # its parameters' names under a layer's
    residual: bool = True          # its own pre-norm and residual add (else the family's)

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS or self.output_gate not in OUTPUT_GATES:
            raise ValueError(f"GQA: qk_norm {self.qk_norm!r} not one of {QK_NORMS}, or output_gate "
                             f"{self.output_gate!r} not one of {OUTPUT_GATES}")
        if self.o_bias and not self.residual:     # its bias is added in its residual add
            raise ValueError("GQA: o_bias needs its own residual add (residual=True)")

    @property
    def projection(self) -> str:
        """Both gates' per-rank columns are `[q | gate | k | v]` (`weights.matrix`)."""
        return "qkv_gate" if self.output_gate else "qkv"

    @property
    def rope_op(self) -> str:
        """The op from the projection to the per-head q and new k: their norm, rotation, both
        or neither."""
        if self.rope:
            return "qk_norm_rope" if self.qk_norm else "rope"
        return "qk_norm" if self.qk_norm else "split_heads"

    @property
    def qk_weights(self) -> tuple[str, ...]:
        """The q/k norms' weight vectors (none for a weightless norm)."""
        return ("q_norm", "k_norm") if self.qk_norm not in ("", "weightless") else ()

    def op_names(self) -> tuple[str, ...]:
        return (*(("input_norm",) if self.residual else ()), self.projection, self.rope_op, "kv_write",
                "attention", *(("out_gate",) if self.output_gate else ()), "o_proj",
                *(("attn_residual",) if self.residual else ()))

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        H, hd = d.hidden_size, d.head_dim
        nq = split(d.num_attention_heads, ways["heads"], "num_attention_heads", "heads")
        nkv = kv_heads_per_part(d, ways["heads"])
        q_cols = (2 if self.output_gate else 1) * nq * hd
        cols = q_cols + 2 * nkv * hd
        norms = self.qk_weights
        bias = ("qkv_bias",) if self.bias else ()
        o_bias = ("o_bias",) if self.o_bias else ()
        sinks = ("sinks",) if self.sinks else ()
        ops = (
            *((Op("input_norm", reads=("x", "input_norm"), writes=("h",)),) if self.residual else ()),
            Op(self.projection, reads=("h", *bias), writes=("proj",), matmul=self.projection),
            Op(self.rope_op, reads=("proj", *norms), writes=("q", "k_new")),
            Op("kv_write", reads=("k_new", "proj"), writes=("key", "value")),
            Op("attention", reads=("q", "key", "value", *sinks), writes=("core",)),
            *((Op("out_gate", reads=("core", "proj"), writes=("core",)),) if self.output_gate else ()),
            Op("o_proj", reads=("core",), writes=("attn_out",), matmul="o_proj"),
            *((Op("attn_residual", reads=("attn_out", *o_bias, "x"), writes=("x",)),)
              if self.residual else ()),
        )
        vector = functools.partial(Tensor, role="vector", dtype="f32")
        tensors = {
            self.projection: Tensor(self.projection, "matrix", (H, cols), "bf16",
                                    format_class="attention"),
            "o_proj": Tensor("o_proj", "matrix", (nq * hd, H), "bf16", partial_out=("heads",),
                             format_class="attention"),
            **{n: vector(n, shape=(hd,)) for n in norms},
            **({"input_norm": vector("input_norm", shape=(H,))} if self.residual else {}),
            **({"qkv_bias": vector("qkv_bias", shape=(cols,))} if self.bias else {}),
            **({"sinks": vector("sinks", shape=(nq,))} if self.sinks else {}),   # a logit a query head
            **({"o_bias": vector("o_bias", shape=(H,))} if self.o_bias else {}),  # added after the reduce
            "key": Tensor("key", "cache", (nkv, hd), "bf16"),      # per token; [ctx, ...] in HBM
            "value": Tensor("value", "cache", (nkv, hd), "bf16"),
        }
        return Part(ops, tensors, {"nq": nq, "nkv": nkv, **({"qkv_cols": cols} if self.bias else {})})


def softmax_scale(d: Any) -> float:
    """The scores' scale: `1/sqrt(head_dim)`, times the dims' `qk_scale_factor` where they have
    one (Muse Spark's 5.4730064863875). Upstream multiplies the normed q by the factor before
    its rotation and scales the scores by `head_dim^-0.5` (`MuseSparkTextAttention.forward`);
    rotation and dot being linear, that is the scores times `qk_scale_factor / sqrt(head_dim)`,
    where the hand kernel applies it (`musespark/attention.py`, `Config.softmax_scale`)."""
    factor = getattr(d, "qk_scale_factor", 1.0)
    return d.head_dim ** -0.5 if factor == 1.0 else factor / d.head_dim ** 0.5


def kv_heads_per_part(d: Any, heads: int) -> int:
    """KV heads each heads part holds: a split when there are enough, else one, the replica of
    the KV head its query heads share (`kv_heads_of`)."""
    if d.num_key_value_heads >= heads:
        return split(d.num_key_value_heads, heads, "num_key_value_heads", "heads")
    split(heads, d.num_key_value_heads, "heads parts per num_key_value_heads", "heads")
    return 1


def kv_heads_of(d: Any, part: int, heads: int) -> list[int]:
    """The KV heads heads part `part` of `heads` holds."""
    n = kv_heads_per_part(d, heads)
    if d.num_key_value_heads >= heads:
        return list(range(part * n, (part + 1) * n))
    return [part * d.num_key_value_heads // heads]


def window_limit(d: Any) -> ContextLimit:
    """A sliding kind's context limit (`LayerKind.context_limit`): without the window's KV ring
    its cache is the core's per-token cache of the whole context, which computes the window
    only while no position reaches past it (slot t holds position t and every written slot is
    inside the window). A longer context needs the ring (`kv ring N slots`), which lifts it."""
    W = d.sliding_window
    return ContextLimit(
        W, f"without a KV ring its per-token KV cache computes its {W}-token window only while "
           "the context is within it",
        f"keep the swa phase's KV cache as the window's ring (`kv ring {max(W, 16)} slots`, a "
        f"multiple of its KV tile; {W} + R - 1 with a verify step of R rows), or write "
        f"`context {W}` or less")

"""Grouped-query attention (`GQA`): pre-norm, one `[q | gate? | k | v]` projection, rotary
embedding (with a per-head RMS norm of q and k first, as an option), the new key and value
written to the KV cache, an online softmax over the cached tokens by KV-head group, an optional
sigmoid output gate, the output projection (a partial sum over the heads' ranks), and the
residual add.

Variants are options of the one kind: Llama 3 is `GQA()`, Qwen3.5's gated attention
`GQA(norm="zero_centred", qk_norm="zero_centred", output_gate=True)`, Qwen3-MoE's
`GQA(qk_norm="plain")`, GPT-OSS's `GQA(bias=True, o_bias=True, sinks=True)` and on its
sliding layers `sliding=True`; a Qwen2-style attention with q/k/v biases and none on o_proj is
`GQA(bias=True)`. The dims a model gives it: hidden_size, num_attention_heads,
num_key_value_heads, head_dim, rms_norm_eps, `sliding_window` for a sliding kind, and its
rotary embedding's (`mkc.layers.rope`; `rotary_dim`, the rotated dims of a head). Heads split
over the `heads` shard class; a part holds its KV heads, or one replica of the KV head its
query heads share when there are fewer KV heads than parts.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.sublayer import Part, Sublayer
from mkc.model.contracts import Dims
from mkc.model.graph import Op, Tensor, split

NORMS = ("plain", "zero_centred")


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
    output_gate: bool = False      # q_proj holds [query | gate] per head; out *= sigmoid(gate)
    bias: bool = False             # q/k/v biases added to the projection
    o_bias: bool = False           # o_proj's bias, added once after its reduce
    sinks: bool = False            # a learned logit per query head joins the softmax's denominator
    sliding: bool = False          # attends to the last `sliding_window` positions only
    prefix: str = "self_attn."     # its parameters' names under a layer's

    @property
    def projection(self) -> str:
        return "qkv_gate" if self.output_gate else "qkv"

    @property
    def rope_op(self) -> str:
        return "qk_norm_rope" if self.qk_norm else "rope"

    def op_names(self) -> tuple[str, ...]:
        return ("input_norm", self.projection, self.rope_op, "kv_write", "attention",
                *(("out_gate",) if self.output_gate else ()), "o_proj", "attn_residual")

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        H, hd = d.hidden_size, d.head_dim
        nq = split(d.num_attention_heads, ways["heads"], "num_attention_heads", "heads")
        nkv = kv_heads_per_part(d, ways["heads"])
        q_cols = (2 if self.output_gate else 1) * nq * hd
        cols = q_cols + 2 * nkv * hd
        norms = ("q_norm", "k_norm") if self.qk_norm else ()
        bias = ("qkv_bias",) if self.bias else ()
        o_bias = ("o_bias",) if self.o_bias else ()
        sinks = ("sinks",) if self.sinks else ()
        ops = (
            Op("input_norm", reads=("x", "input_norm"), writes=("h",)),
            Op(self.projection, reads=("h", *bias), writes=("proj",), matmul=self.projection),
            Op(self.rope_op, reads=("proj", *norms), writes=("q", "k_new")),
            Op("kv_write", reads=("k_new", "proj"), writes=("key", "value")),
            Op("attention", reads=("q", "key", "value", *sinks), writes=("core",)),
            *((Op("out_gate", reads=("core", "proj"), writes=("core",)),) if self.output_gate else ()),
            Op("o_proj", reads=("core",), writes=("attn_out",), matmul="o_proj"),
            Op("attn_residual", reads=("attn_out", *o_bias, "x"), writes=("x",)),
        )
        vector = functools.partial(Tensor, role="vector", dtype="f32")
        tensors = {
            self.projection: Tensor(self.projection, "matrix", (H, cols), "bf16",
                                    format_class="attention"),
            "o_proj": Tensor("o_proj", "matrix", (nq * hd, H), "bf16", partial_out=("heads",),
                             format_class="attention"),
            **{n: vector(n, shape=(hd,)) for n in norms},
            "input_norm": vector("input_norm", shape=(H,)),
            **({"qkv_bias": vector("qkv_bias", shape=(cols,))} if self.bias else {}),
            **({"sinks": vector("sinks", shape=(nq,))} if self.sinks else {}),   # a logit a query head
            **({"o_bias": vector("o_bias", shape=(H,))} if self.o_bias else {}),  # added after the reduce
            "key": Tensor("key", "cache", (nkv, hd), "bf16"),      # per token; [ctx, ...] in HBM
            "value": Tensor("value", "cache", (nkv, hd), "bf16"),
        }
        return Part(ops, tensors, {"nq": nq, "nkv": nkv, **({"qkv_cols": cols} if self.bias else {})})


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

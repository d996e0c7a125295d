"""Multi-head latent attention (`MLA`, DeepSeek-V2/V3's and Kimi K3's), decoded weight-absorbed
over a cache of compressed latents: q = q_up(rms(q_down(h))) per head `[nope | rope]`; the new
cache row `[rms(c) | k_rope]` from one kv_down projection (`c` the kv_lora_rank latent,
`k_rope` the qk_rope_head_dim key part every head shares); the key up-projection absorbed into
the query (`key_up`), scores over the cached latents by an online softmax, the value
up-projection applied to the probability-weighted latent average (`value_up`); an optional
sigmoid output gate; the output projection (a partial sum over the heads' ranks).

Variants are options of the one kind: DeepSeek-V3's is `MLA(rope=True)`: the `rope` part of
the query and of the shared key rotated at the row's position (rotate-half pairs; a config's
`rope_interleave` pairs `(2i, 2i + 1)`, which packing turns into rotate-half pairs by
permuting q_b_proj's and kv_a_proj_with_mqa's rope rows: `mkc.layers.mla.weights`), the
scores scaled by `softmax_scale`; Kimi K3's is `MLA(output_gate=True, residual=False)`: no
rotation (NoPE), `sigmoid(g_proj(h))` on the output, and its input mix and residual add its
family's own (block attention residuals).

The dims a model gives it, by their upstream names: hidden_size, rms_norm_eps,
num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
v_head_dim; with `rope`, its rotary embedding's (`mkc.layers.rope`: head_dim and rotary_dim
both qk_rope_head_dim) and `rope_interleave`, and `yarn_mscale` (YaRN's `mscale_all_dim`
factor on the softmax scale, squared; 1 without). Heads split over the `heads` shard class;
q_down, kv_down and the latent cache are whole on every rank.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mkc.layers.sublayer import Part, Sublayer
from mkc.model.contracts import Dims
from mkc.model.graph import Op, Tensor, lane_pad, split


@dataclass(frozen=True)
class MLADims(Dims):
    """The dims of a decoder whose attention is an MLA kind with rotary embedding on its rope
    part (`MLA(rope=True)`); a family's subclass adds its other layers'. `head_dim` and
    `rotary_dim` are the rope part's width, as upstream's DeepseekV3Config sets `head_dim`
    (the rotary table's)."""

    rms_norm_eps: float
    layer_kinds: tuple[str, ...]
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rope_type: str                # "default" or "yarn" (`mkc.layers.rope.read_yarn`'s fields)
    yarn_factor: float
    yarn_low: float = field(metadata={"any_sign": True})    # may be 0 (clamped at 0 upstream)
    yarn_high: float
    yarn_attention_factor: float
    yarn_mscale: float            # the softmax scale's YaRN factor (taken twice)


def softmax_scale(d: Any) -> float:
    """The scores' scale: `(qk_nope_head_dim + qk_rope_head_dim)^-0.5`, times `yarn_mscale`
    twice where the model has one (upstream's `yarn_apply_mscale`, in its order)."""
    scale = (d.qk_nope_head_dim + d.qk_rope_head_dim) ** -0.5
    mscale = getattr(d, "yarn_mscale", 1.0)
    return scale if mscale == 1.0 else scale * mscale * mscale


def interleaved(d: Any) -> bool:
    """Whether the checkpoint's rope dims pair `(2i, 2i + 1)` (packing permutes them)."""
    return bool(getattr(d, "rope_interleave", False))


@dataclass(frozen=True)
class MLA(Sublayer):
    package = "mkc.layers.mla"

    rope: bool = False             # rotate the rope part of q and of the shared key (else NoPE)
    output_gate: bool = False      # out *= sigmoid(g_proj(h)) (K3's)
    residual: bool = True          # its own pre-norm and residual add (else the family's)
    prefix: str = "self_attn."     # its parameters' names under a layer's

    def op_names(self) -> tuple[str, ...]:
        return (*(("input_norm",) if self.residual else ()), "q_down", "kv_down", "latent_norms",
                "kv_write", "q_up", "absorb_query", "attention", "values_out",
                *(("gate", "out_gate") if self.output_gate else ()), "o_proj",
                *(("attn_residual",) if self.residual else ()))

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        """Matrices first (K3's vector block puts its mix vectors after them), then vectors and
        the latent cache."""
        H, nope, rope, v = d.hidden_size, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
        heads = split(d.num_attention_heads, ways["heads"], "num_attention_heads", "heads")
        width = cache_width(d)
        # an attention projection (`format attention ...`); key_up and value_up, which ops
        # read whole, are in no class
        matrix = functools.partial(Tensor, role="matrix", dtype="bf16", format_class="attention")
        vector = functools.partial(Tensor, role="vector", dtype="f32")
        gate = (Op("gate", reads=("h",), writes=("gate_logits",), matmul="gate"),
                Op("out_gate", reads=("core", "gate_logits"), writes=("core",))) if self.output_gate else ()
        ops = (
            *((Op("input_norm", reads=("x", "input_norm"), writes=("h",)),) if self.residual else ()),
            Op("q_down", reads=("h",), writes=("q_low",), matmul="q_down"),
            Op("kv_down", reads=("h",), writes=("kv_row",), matmul="kv_down"),
            Op("latent_norms", reads=("q_low", "kv_row", "q_norm", "kv_norm"), writes=("q_low", "kv_row")),
            Op("kv_write", reads=("kv_row",), writes=("latent",)),
            Op("q_up", reads=("q_low",), writes=("q",), matmul="q_up"),
            Op("absorb_query", reads=("q", "key_up"), writes=("q_lat",)),
            Op("attention", reads=("q_lat", "latent"), writes=("lat_avg",)),
            Op("values_out", reads=("lat_avg", "value_up"), writes=("core",)),
            *gate,
            Op("o_proj", reads=("core",), writes=("attn_out",), matmul="o_proj"),
            *((Op("attn_residual", reads=("attn_out", "x"), writes=("x",)),) if self.residual else ()),
        )
        tensors = {
            "q_down": matrix("q_down", shape=(H, d.q_lora_rank)),                 # replicated
            "kv_down": matrix("kv_down", shape=(H, width)),                       # replicated
            "q_up": matrix("q_up", shape=(d.q_lora_rank, heads * (nope + rope))),  # nope | rope
            "key_up": matrix("key_up", shape=(heads * nope, d.kv_lora_rank),     # absorbed in q
                             format_class=""),
            "value_up": matrix("value_up", shape=(d.kv_lora_rank, heads * v), format_class=""),
            **({"gate": matrix("gate", shape=(H, heads * v))} if self.output_gate else {}),
            "o_proj": matrix("o_proj", shape=(heads * v, H), partial_out=("heads",)),
            **({"input_norm": vector("input_norm", shape=(H,))} if self.residual else {}),
            "q_norm": vector("q_norm", shape=(d.q_lora_rank,)),
            "kv_norm": vector("kv_norm", shape=(d.kv_lora_rank,)),
            "latent": Tensor("latent", "cache", (width,), "bf16"),                # per token
        }
        return Part(ops, tensors, {"heads": heads, "cache_width": width})


def cache_width(d: Any) -> int:
    """A latent cache row: kv_lora_rank + qk_rope_head_dim, lane padded."""
    return lane_pad(d.kv_lora_rank + d.qk_rope_head_dim)

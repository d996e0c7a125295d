"""The reference of `MoE` (transformers' `Qwen3MoeSparseMoeBlock`, `Qwen3_5MoeSparseMoeBlock`)
on the post-attention-normed ``x [B, H]``, all in f32 with ``Precision.HIGHEST`` dots:

* router (``mlp.gate.weight [E, H]``, no bias): ``probs = softmax(x @ gate^T)`` over all E
  experts; the ``top_k`` largest; divided by their sum when ``norm_topk_prob``. Upstream then
  casts the weights to the activations' dtype (bf16 in a bf16 model); this f32 oracle keeps
  them f32, as it keeps every activation f32;
* routed expert e (stored fused): ``experts.gate_up_proj[e]`` ``[2I, H]`` holds the gate rows
  ``0..I-1`` then the up rows (upstream chunks the product in two along its output axis);
  ``expert_e(x) = experts.down_proj[e] @ (silu(gate) * up)`` with ``down_proj[e]`` ``[H, I]``;
* with ``s.shared_expert``: ``mlp.shared_expert`` a SwiGLU MLP of width
  ``shared_expert_intermediate_size``, times ``sigmoid(x @ shared_expert_gate.weight^T)``;
* output: ``sum_k w_k expert_{id_k}(x) (+ sigmoid(...) * shared(x))``, added to the residual.

Kernel rounding emulation (``rounding``): every matmul takes bf16 activations; the routed
experts become per-rank partial sums: rank r belongs to expert group ``r // expert_tp``
(experts ``group * local_experts ...`` in id order) and holds width slice ``r % expert_tp``
(``expert_width`` columns) of each, its gate and up columns multiplied in one dot, as the
kernel's slot holds them (``[gate | up]``: XLA's CPU f32 dot, which the FP8 experts' mixed dots
are, sums a 256-wide product in another order than two 128-wide ones; measured,
``mkc.numerics``); it adds each expert's output times the row's routing weight (0 where the
row did not pick it) in expert-id order, one fused multiply-add each, and the partials are
all-reduced as ``(kind, "routed_experts")``; the routing weights are the kernel's: the picked
softmax probabilities over all E lanes, zero elsewhere, divided by their lane sum
(``_kernel_route_weights``). The shared expert is the dense SwiGLU's emulation (``shared``
columns per rank, all-reduced as ``(kind, "shared_down")``). The block is added to the
residual stream as the kernel's ``mlp_residual`` adds it (``residual``): the routed sum first,
then the shared expert times its sigmoid gate, a lane sum of the bf16 input times the gate
vector. Each of these is written in the kernel's expression and shapes, jitted, since XLA's
f32 order depends on both (``mkc.numerics``: measured at batch 8, where the sums over the k
picks and the block's own sum were off).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mkc.layers.expert_formats.reference import expert_operands
from mkc.layers.moe import MoE
from mkc.layers.reference import NORM, linear, matmul, mm_input, out_projection
from mkc.layers.swiglu.reference import block as swiglu_block
from mkc.reference.rounding import Rounding, allreduce

HIGHEST = jax.lax.Precision.HIGHEST
EXPERTS = ("gate_up", "down")


def route(logits: jax.Array, top_k: int, renormalize: bool = True) -> tuple[jax.Array, jax.Array]:
    """Softmax routing ``[..., E] -> (ids [..., k], weights [..., k])``, largest first: the top-k
    softmax probabilities over all experts, divided by their sum when ``renormalize``."""
    probs, _ = selection_scores(logits, top_k)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids, weights


def selection_scores(logits: jax.Array, top_k: int, renormalize: bool = True
                     ) -> tuple[jax.Array, int]:
    """What ``route`` (same arguments) takes the top k of, and that k: the softmax
    probabilities. The harness's near-tie rule reads it (``examples/generated_module``)."""
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1), top_k


@functools.partial(jax.jit, static_argnames="renormalize")
def _kernel_route_weights(logits: jax.Array, ids: jax.Array, renormalize: bool = True) -> jax.Array:
    """Routing weights over every expert ``[B, E]`` as the kernel forms them
    (``mkc.layers.moe.lowering.route_weights``), jitted: the softmax probabilities of the picked
    ``ids`` (zero elsewhere), divided by their sum over all E lanes when ``renormalize``. Their
    sum over the k picks (``route``) adds the same values in another f32 order: a weight one
    ulp apart flips a bf16 wire rounding of the routed experts' all-reduce (measured, batch 8:
    2.4e-4 in one row's MoE output, 1.2e-4 in its logits)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    rows = jnp.arange(logits.shape[0])[:, None]
    kept = jnp.zeros_like(probs).at[rows, ids].set(jnp.take_along_axis(probs, ids, axis=-1))
    return kept / jnp.sum(kept, axis=-1, keepdims=True) if renormalize else kept


@jax.jit
def _kernel_weighted_add(acc: jax.Array, weight: jax.Array, out: jax.Array) -> jax.Array:
    """``acc + weight * out`` as the kernel's expert loop adds one weighted expert (fused: one
    FMA; a multiply and an add apart round twice)."""
    return acc + weight * out


def _routed_experts_per_rank(s: MoE, p: Mapping[str, jax.Array], d: Any, xin: jax.Array, dense: jax.Array,
                             rounding: Rounding, kind: str) -> jax.Array:
    """The routed experts as an expert-parallel kernel computes them (module docstring): each
    rank's part of its group's experts on every row, weighted by the row's routing weight
    (``dense [B, E]``, ``_kernel_route_weights``: 0 where not picked, and such an expert adds
    exactly nothing, as one the kernel skips), summed in expert-id order, the ranks' partial
    sums all-reduced."""
    b, inter = xin.shape[0], d.moe_intermediate_size
    tp, width, local = (rounding.size(n) for n in ("expert_tp", "expert_width", "local_experts"))
    gate_up, down = p["experts.gate_up_proj"], p["experts.down_proj"]
    # FP8 experts: one mixed bf16 x fp8 dot a pack group, on the requantized values; bf16
    # experts: one bf16 dot.
    operands = {m: expert_operands(rounding, m) for m in EXPERTS}
    fp8 = {m for m in EXPERTS if getattr(rounding.weight_format(f"expert.{m}"), "name", "") == "fp8"}
    rows = {m: s.pack_groups(d)[m] if m in fp8 else None for m in EXPERTS}

    def expert_linear(x: jax.Array, w: jax.Array, m: str) -> jax.Array:
        return rounding.linear(x, w, rows[m], operands[m])

    partials = []
    for r in range(rounding.ranks):
        group, part = r // tp, r % tp
        cols = slice(part * width, (part + 1) * width)
        acc = jnp.zeros((b, d.hidden_size), jnp.float32)
        for e in range(group * local, min((group + 1) * local, d.experts)):
            # One dot of the rank's gate and up rows together, as its slot holds them
            # ([gate | up]): XLA's CPU f32 dot sums a 2 * width wide product in another order
            # than two width wide ones (module docstring).
            fused = gate_up[e].reshape(2, inter, -1)[:, cols].reshape(2 * width, -1)
            hidden = expert_linear(xin, fused, "gate_up")
            act = jax.nn.silu(hidden[:, :width]) * hidden[:, width:]
            acc = _kernel_weighted_add(acc, dense[:, e:e + 1], expert_linear(act, down[e][:, cols], "down"))
        partials.append(acc)
    return allreduce(partials, rounding.reduce(kind, "routed_experts"))


def _shared_expert(p: Mapping[str, jax.Array], x: jax.Array, rounding: Rounding | None,
                   kind: str) -> jax.Array:
    """The shared expert: a SwiGLU MLP; with ``rounding`` its down projection is the
    schedule's ``shared_down`` of ``kind``, split over ranks in ``shared``-wide ranges."""
    if rounding is None:
        return swiglu_block(p, x)
    act = jax.nn.silu(rounding.linear(x, p["gate_proj.weight"])) * rounding.linear(x, p["up_proj.weight"])
    return out_projection(act, p["down_proj.weight"], rounding, kind, "shared_down",
                          rounding.size("shared"), "mlp")


def parts(s: MoE, p: Mapping[str, jax.Array], d: Any, x: jax.Array, rounding: Rounding | None,
          kind: str) -> tuple[jax.Array, jax.Array | None]:
    """The block's routed experts (summed) and shared expert (before its gate; None without
    one), each all-reduced as the schedule says when ``rounding`` is given. ``p`` maps names
    relative to ``s.prefix`` to f32 arrays."""
    s.bf16_checkpoint("reference")
    inter = d.moe_intermediate_size
    xin = mm_input(x, rounding)
    logits = matmul(xin, p["gate.weight"], rounding)
    ids, weights = route(logits, d.top_k, d.norm_topk_prob)
    if rounding is None:
        hidden = jnp.einsum("bh,bkoh->bko", xin, p["experts.gate_up_proj"][ids], precision=HIGHEST)
        act = jax.nn.silu(hidden[..., :inter]) * hidden[..., inter:]
        out = jnp.einsum("bki,bkoi->bko", act, p["experts.down_proj"][ids], precision=HIGHEST)
        routed = jnp.einsum("bk,bko->bo", weights, out, precision=HIGHEST)
    else:
        routed = _routed_experts_per_rank(s, p, d, xin, _kernel_route_weights(logits, ids, d.norm_topk_prob),
                                          rounding, kind)
    if not s.shared_expert:
        return routed, None
    shared = {n[len("shared_expert."):]: w for n, w in p.items() if n.startswith("shared_expert.")}
    return routed, _shared_expert(shared, x, rounding, kind)


@jax.jit
def _kernel_mlp_residual(resid: jax.Array, routed: jax.Array, h: jax.Array, gate_w: jax.Array,
                         shared: jax.Array) -> jax.Array:
    """The residual stream after the block as the kernel's ``mlp_residual`` adds it, jitted:
    ``resid + routed`` first, then the gated shared expert (fused: one FMA), the gate
    ``sigmoid`` of a lane sum of the bf16-rounded ``h`` times ``gate_w [1, H]`` (not a dot).
    Adding the block's sum ``routed + gate * shared`` instead is an ulp or two off in most
    rows (measured, batch 8: every row of every MoE layer's output)."""
    hb = h.astype(jnp.bfloat16).astype(jnp.float32)
    gate = jax.nn.sigmoid(jnp.sum(hb * gate_w, axis=-1, keepdims=True))
    return resid + routed + gate * shared


def block(s: MoE, p: Mapping[str, jax.Array], d: Any, x: jax.Array, rounding: Rounding | None = None,
          kind: str = "") -> jax.Array:
    """The block's output for the normed ``x [B, H]`` (``p`` relative to ``s.prefix``). With
    ``rounding``, ``kind`` names the layer kind whose all-reduces apply (the emulation adds the
    block to the residual stream as the kernel does: ``residual``)."""
    routed, shared = parts(s, p, d, x, rounding, kind)
    if shared is None:
        return routed
    gate = jax.nn.sigmoid(linear(mm_input(x, rounding), p["shared_expert_gate.weight"]))   # [B, 1]
    return routed + gate * shared


def residual(s: MoE, p: Mapping[str, jax.Array], d: Any, resid: jax.Array, x: jax.Array,
             rounding: Rounding | None = None, kind: str = "") -> jax.Array:
    """The residual stream ``resid`` after the block of the normed ``x``: plainly ``resid +
    block(...)``; with ``rounding`` in the kernel's order (``_kernel_mlp_residual``)."""
    if rounding is None:
        return resid + block(s, p, d, x)
    routed, shared = parts(s, p, d, x, rounding, kind)
    if shared is None:
        return resid + routed
    return _kernel_mlp_residual(resid, routed, x, p["shared_expert_gate.weight"], shared)


def forward(s: MoE, lp: Mapping[str, jax.Array], d: Any, x: jax.Array, cache: dict, layer: int,
            positions: jax.Array, rounding: Rounding | None, kind: str) -> jax.Array:
    """The residual stream after the layer's MoE (its pre-norm, the block, the residual add)."""
    h = NORM[s.norm](x, lp["post_attention_layernorm.weight"], d.rms_norm_eps)
    sub = {n[len(s.prefix):]: w for n, w in lp.items() if n.startswith(s.prefix)}
    return residual(s, sub, d, x, h, rounding, kind)


def block_shapes(s: MoE, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The block's upstream parameters, in upstream module order, under layer prefix
    `prefix` (`model.layers.{i}.`)."""
    H, E, inter, p, bf16 = d.hidden_size, d.experts, d.moe_intermediate_size, prefix + s.prefix, "bfloat16"
    shapes = {p + "gate.weight": ((E, H), bf16),
              p + "experts.gate_up_proj": ((E, 2 * inter, H), bf16),
              p + "experts.down_proj": ((E, H, inter), bf16)}
    if s.shared_expert:
        shared = d.shared_expert_intermediate_size
        shapes |= {p + "shared_expert.gate_proj.weight": ((shared, H), bf16),
                   p + "shared_expert.up_proj.weight": ((shared, H), bf16),
                   p + "shared_expert.down_proj.weight": ((H, shared), bf16),
                   p + "shared_expert_gate.weight": ((1, H), bf16)}
    return shapes


def param_shapes(s: MoE, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    norm = {prefix + "post_attention_layernorm.weight": ((d.hidden_size,), "bfloat16")}
    return block_shapes(s, d, prefix) | norm


def init_cache(s: MoE, d: Any, layer: int, batch: int, context: int, dtype: Any = None
               ) -> dict[str, jax.Array]:
    return {}

"""The reference of `MoE` (transformers' `Qwen3MoeSparseMoeBlock`, `Qwen3_5MoeSparseMoeBlock`,
`DeepseekV3MoE`) on the post-attention-normed ``x [B, H]``, all in f32 with ``Precision.HIGHEST``
dots:

* router (``mlp.gate.weight [E, H]``, no bias): ``probs = softmax(x @ gate^T)`` over all E
  experts; the ``top_k`` largest; divided by their sum when ``norm_topk_prob``. Upstream then
  casts the weights to the activations' dtype (bf16 in a bf16 model); this f32 oracle keeps
  them f32, as it keeps every activation f32;
* routed expert e (stored fused): ``experts.gate_up_proj[e]`` ``[2I, H]`` holds the gate rows
  ``0..I-1`` then the up rows (upstream chunks the product in two along its output axis);
  ``expert_e(x) = experts.down_proj[e] @ (silu(gate) * up)`` with ``down_proj[e]`` ``[H, I]``;
  from an FP8 checkpoint the codes times their f32 block scales (``expert_values``; the
  emulation multiplies the codes, each group's partial product times its scales, as the
  kernel does); from an NVFP4 checkpoint (Muse Spark's `-NVFP4`) the e2m1 codes times their
  e4m3 scales, exact in f32, each product times the matrix's global scale (``_picked``,
  ``_global_scaled``); int4 experts are the requantization's codes times their bf16 scales
  (``expert_values``, `weights.requantization`); the emulation multiplies both as the kernel
  does (``four_bit_linear``);
* sigmoid routing (``route``): ``sigmoid(x @ gate^T)`` scores, the top k of them plus
  ``gate.e_score_correction_bias`` among the best groups, weighted by their scores
  (renormalised when ``norm_topk_prob``) times ``routed_scaling_factor``;
* GPT-OSS's options (``GptOssMLP``): the router ``mlp.router`` (``s.router_prefix``) with a
  bias on its logits; the top-k softmax (``route``'s "top_k_softmax": the k largest logits,
  their softmax over those k only); MXFP4 experts decoded exactly (``mxfp4_experts``), their
  gate and up rows interleaved (``s.gate_up_interleaved``), a bias after each product, and the
  clamped SwiGLU ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate,
  limit)`` (``clamped_swiglu``); the emulation multiplies each expert as its slot holds it
  (``_slot_expert``: ``[gate | up]`` halves padded to whole lane tiles, pack group by pack
  group);
* with ``s.shared_expert``: ``mlp.shared_expert`` (``s.shared_prefix``) a SwiGLU MLP of width
  ``shared_expert_intermediate_size``, times ``sigmoid(x @ shared_expert_gate.weight^T)``
  unless ``s.shared_gate`` is false;
* with ``s.latent`` (`Latent`): the experts run on ``down(x)`` (Kimi K3's
  ``routed_expert_down_proj``, Muse Spark's ``pre_expert_proj``) and their sum is projected
  back by ``up``; the latent's norm on the sum (K3's ``routed_expert_norm``, plain) or on the
  projected input before the experts (Muse Spark's ``pre_expert_norm``, ``1 + w``); with its
  ``expert_norm`` (Muse Spark's ``experts.post_expert_norm``) each expert's output
  ``y * (1 + w)`` RMS-normed (eps ``post_norm_eps``) before its weight (``input_scaled_norm``);
* Muse Spark's router (``ScaledSigmoid``, ``MuseSparkTopkRouter``): the f32 weight's logits
  times ``output_multiplier``, the sigmoid router's picks, the weights over their sum plus
  1e-15;
* output: ``sum_k w_k expert_{id_k}(x) (+ sigmoid(...) * shared(x))``, added to the residual.

Kernel rounding emulation (``rounding``): every matmul takes bf16 activations; the routed
experts become per-rank partial sums: rank r belongs to expert group ``r // expert_tp``
(experts ``group * local_experts ...`` in id order) and holds width slice ``r % expert_tp``
(``expert_width`` columns) of each, its gate and up columns multiplied in one dot, as the
kernel's slot holds them (``[gate | up]``: XLA's CPU f32 dot, which the FP8 experts' mixed
dots are, sums a 256-wide product in another order than two 128-wide ones; measured,
``mkc.numerics``); it adds each expert's output times the row's routing weight (0 where the
row did not pick it) in expert-id order, one fused multiply-add each, and the partials are
all-reduced as ``(kind, "routed_experts")``; the routing weights are the kernel's: the picked
softmax probabilities over all E lanes, zero elsewhere, divided by their lane sum
(``_kernel_route_weights``). With an expert norm the ranks' partials are each row's picks'
outputs side by side (``expert_parallel_picks``), all-reduced, then normed, weighted and
summed pick by pick (``kernel_expert_norm``); an f32 router is the kernel's one product of its
bf16 pair ``[hi | lo]`` (``router_pair``), the halves summed (``router_logits``). The shared
expert is the dense SwiGLU's emulation (``shared`` columns per rank, all-reduced as ``(kind,
"shared_down")``). The block is added to the residual stream as the kernel's ``mlp_residual``
adds it (``residual``): the routed sum first, then the shared expert times its sigmoid gate, a
lane sum of the bf16 input times the gate vector. Each of these is written in the kernel's
expression and shapes, jitted, since XLA's f32 order depends on both (``mkc.numerics``:
measured at batch 8, where the sums over the k picks and the block's own sum were off).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mkc.ir import WeightFormat
from mkc.layers.expert_formats import FOUR_BIT, MX_BLOCK, NVFP4_BLOCK, block_groups, block_index, pack_groups
from mkc.layers.expert_formats.reference import expert_operands, int4_linear, nvfp4_linear, nvfp4_unit_values
from mkc.layers.expert_formats.weights import nvfp4_draw, unpack_int4_from_kernel
from mkc.layers.moe import BLOCK_SCALE, MoE
from mkc.layers.moe.options import ROUTERS, Checkpoint, Router, ScaledSigmoid, Sigmoid, Softmax, TopKSoftmax
from mkc.layers.moe.weights import NVFP4_GLOBAL, NVFP4_SCALE, PACKED_BLOCK_SCALE, int4_slot, nvfp4_slot
from mkc.layers.reference import NORM, input_scaled_norm, linear, matmul, mm_input, own_norm
from mkc.layers.reference import activation as activate
from mkc.layers.swiglu.reference import block as gated_mlp
from mkc.model.fp8_blocks import dequantize
from mkc.model.mxfp4 import mxfp4_dequantize_jax, mxfp4_quantize
from mkc.reference.rounding import Rounding, allreduce, round_to

HIGHEST = jax.lax.Precision.HIGHEST
EXPERTS = ("gate_up", "down")


def route(logits: jax.Array, top_k: int, renormalize: bool = True, scoring: str = "softmax",
          bias: jax.Array | None = None, scaling: float = 1.0, groups: int = 1, topk_groups: int = 1
          ) -> tuple[jax.Array, jax.Array]:
    """Routing ``[..., E] -> (ids [..., k], weights [..., k])``, largest first, by the router
    named ``scoring`` (`mkc.layers.moe.options.ROUTERS`). "softmax": the top-k softmax
    probabilities over all experts, divided by their sum when ``renormalize``. "top_k_softmax"
    (`GptOssTopKRouter`): the k largest logits, their softmax over those k only. "sigmoid"
    (`DeepseekV3TopkRouter`, Kimi K3's): the top k of ``sigmoid + bias`` (the correction bias
    picks, it does not weight) among the ``topk_groups`` best of ``groups`` groups (a group's
    score the sum of its two largest), weighted by their sigmoid scores, divided by their sum
    when ``renormalize``, times ``scaling``."""
    return ROUTER_MATH[type(ROUTERS[scoring])].route(logits, top_k, renormalize, bias, scaling, groups,
                                                     topk_groups)


def softmax_scores(logits: jax.Array) -> jax.Array:
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)


def softmax_route(logits, top_k, renormalize, bias, scaling, groups, topk_groups):
    weights, ids = jax.lax.top_k(softmax_scores(logits), top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids, weights


def softmax_selection(logits, top_k, bias, groups, topk_groups):
    return softmax_scores(logits), top_k


def top_k_softmax_scores(logits: jax.Array) -> jax.Array:
    # the row max is the largest pick's logit: exp(logit - max) over the picks is their
    # softmax over the k once divided by its lane sum
    return jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))


def top_k_softmax_route(logits, top_k, renormalize, bias, scaling, groups, topk_groups):
    top, ids = jax.lax.top_k(logits, top_k)
    return ids, jax.nn.softmax(top, axis=-1)


def top_k_softmax_selection(logits, top_k, bias, groups, topk_groups):
    return logits, top_k


def sigmoid_scores(logits: jax.Array) -> jax.Array:
    return jax.nn.sigmoid(logits)


def sigmoid_route(logits, top_k, renormalize, bias, scaling, groups, topk_groups, eps=0.0):
    scores = jax.nn.sigmoid(logits)
    pick = scores + bias
    if groups > 1:
        pick = jnp.where(eligible(pick, groups, topk_groups), pick, -jnp.inf)
    _, ids = jax.lax.top_k(pick, top_k)
    chosen = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        chosen = chosen / (jnp.sum(chosen, axis=-1, keepdims=True) + eps)
    return ids, chosen * scaling


def sigmoid_selection(logits, top_k, bias, groups, topk_groups):
    # group-limited, two choices: the biased scores with the other groups' experts at -1e30
    # (finite, so two runs' scores subtract) and their top k, then the group scores and their
    # top `topk_groups`
    pick = jax.nn.sigmoid(logits) + bias
    if groups == 1:
        return pick, top_k
    return [(jnp.where(eligible(pick, groups, topk_groups), pick, -1e30), top_k),
            (group_scores(pick, groups), topk_groups)]


# Muse Spark's (`ScaledSigmoid`): the sigmoid router's on logits its router op has scaled, the
# renormalising sum plus upstream's 1e-15
def scaled_sigmoid_route(logits, top_k, renormalize, bias, scaling, groups, topk_groups):
    return sigmoid_route(logits, top_k, renormalize, bias, scaling, groups, topk_groups,
                         ScaledSigmoid.eps)


class RouterMath(NamedTuple):
    """A router's reference math: `route` (``route``'s arguments), `selection` (what it takes
    the top k of, and that k: ``selection_scores``) and `scores` (the scores whose picks the
    kernel keeps as weights: ``dense_route_weights``)."""

    route: Callable
    selection: Callable
    scores: Callable


# Each router's, by its type (`mkc.layers.moe.options`)
ROUTER_MATH: dict[type[Router], RouterMath] = {
    Softmax: RouterMath(softmax_route, softmax_selection, softmax_scores),
    TopKSoftmax: RouterMath(top_k_softmax_route, top_k_softmax_selection, top_k_softmax_scores),
    Sigmoid: RouterMath(sigmoid_route, sigmoid_selection, sigmoid_scores),
    ScaledSigmoid: RouterMath(scaled_sigmoid_route, sigmoid_selection, sigmoid_scores),
}


def group_scores(pick: jax.Array, groups: int) -> jax.Array:
    """``[B, E] -> [B, groups]``: each group's two largest values summed."""
    grouped = pick.reshape(*pick.shape[:-1], groups, pick.shape[-1] // groups)
    return jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)


def eligible(pick: jax.Array, groups: int, topk_groups: int) -> jax.Array:
    """``[B, E]`` bool: the experts of each row's ``topk_groups`` best groups."""
    _, best = jax.lax.top_k(group_scores(pick, groups), topk_groups)
    kept = jnp.any(best[..., :, None] == jnp.arange(groups), axis=-2)        # [B, groups]
    return jnp.repeat(kept, pick.shape[-1] // groups, axis=-1)


def selection_scores(logits: jax.Array, top_k: int, renormalize: bool = True, scoring: str = "softmax",
                     bias: jax.Array | None = None, scaling: float = 1.0, groups: int = 1,
                     topk_groups: int = 1) -> tuple[jax.Array, int] | list[tuple[jax.Array, int]]:
    """What ``route`` (same arguments) takes the top k of, and that k: the softmax
    probabilities, the logits (top-k softmax), or the sigmoid scores plus the bias (with
    groups, two choices: `Sigmoid.selection`). The harness's near-tie rule reads it
    (``examples/generated_module``)."""
    return ROUTER_MATH[type(ROUTERS[scoring])].selection(logits, top_k, bias, groups, topk_groups)


def dense_route_weights(logits: jax.Array, ids: jax.Array, renormalize: bool = True,
                        scoring: str = "softmax", scaling: float = 1.0) -> jax.Array:
    """Routing weights over every expert ``[B, E]`` as the kernel forms them
    (``mkc.layers.moe.lowering``): the router's scores (`RouterMath.scores`: softmax
    probabilities, ``exp(logit - row max)``, sigmoid scores) at the picked ``ids`` (zero
    elsewhere), divided by their sum over all E lanes when ``renormalize``, times ``scaling``
    (1 but for the sigmoid router's)."""
    router = ROUTERS[scoring]
    scores = ROUTER_MATH[type(router)].scores(logits)
    rows = jnp.arange(logits.shape[0])[:, None]
    kept = jnp.zeros_like(scores).at[rows, ids].set(jnp.take_along_axis(scores, ids, axis=-1))
    if renormalize:
        total = jnp.sum(kept, axis=-1, keepdims=True)
        kept = kept / (total + router.eps if router.eps else total)
    return kept * scaling


# Jitted: their sum over the k picks (``route``) adds the same values in another f32 order, and
# a weight one ulp apart flips a bf16 wire rounding of the routed experts' all-reduce
# (measured, batch 8: 2.4e-4 in one row's MoE output, 1.2e-4 in its logits).
_kernel_route_weights = jax.jit(dense_route_weights, static_argnames=("renormalize", "scoring", "scaling"))


def init_weight(s: MoE, name: str, shape: tuple[int, ...], rng: np.random.Generator, residual_scale: float
                ) -> np.ndarray | dict[str, np.ndarray] | None:
    """The correction bias drawn N(0, 0.05) (its scores' spread is about 0.2: it reorders
    close picks); router and expert biases N(0, 0.1) (down's times `residual_scale`: it writes
    the residual stream), so every bias path is exercised (upstream initialises them to zero);
    MXFP4 experts drawn as f32 N(0, 1/fan_in) (down's times `residual_scale`) and stored through
    ``mxfp4_quantize``: their blocks valid codes, with their scales (in 1..254); an NVFP4
    checkpoint's as `nvfp4_draw` draws them (drawn at their `_weight_scale`, the codes'
    earlier draw replaced), their values' RMS 1/sqrt(fan_in) likewise, and input scales of
    about 1/448 (which a bf16-activation kernel does not read); Kimi's
    per-expert MXFP4 likewise from f64 draws, down unscaled (with `latent`, `latent_up` writes
    the stream: it is scaled); the rest as the decoder draws them (None)."""
    if name.endswith("e_score_correction_bias"):
        return rng.normal(0.0, 0.05, shape)
    if ((s.router_bias and name.endswith(s.router_prefix + "bias"))
            or (s.expert_bias and name.endswith("_proj_bias"))):
        return rng.normal(0.0, 0.1 * (residual_scale if name.endswith("down_proj_bias") else 1.0), shape)
    if name.endswith(".weight_packed"):              # Kimi's per-expert MXFP4
        values = (shape[0], 2 * shape[1])           # two codes a byte
        codes, scales = mxfp4_quantize(rng.normal(0.0, 1.0 / math.sqrt(values[1]), values))
        return {name: codes, name.replace("weight_packed", "weight_scale"): scales}
    latent_up = bool(s.latent) and name.endswith(s.latent.up)      # writes the stream
    if latent_up or (s.latent and name.endswith(s.latent.down)):
        std = 1.0 / math.sqrt(shape[-1])
        return rng.normal(0.0, std * residual_scale if latent_up else std, shape)
    if name.endswith("_proj" + NVFP4_SCALE):      # an NVFP4 checkpoint's: drawn with its codes
        codes = name.removesuffix(NVFP4_SCALE)
        writes = codes.endswith("down_proj") and not s.latent
        std = 1.0 / math.sqrt(shape[-1] * NVFP4_BLOCK) * (residual_scale if writes else 1.0)
        values, scales, glob = nvfp4_draw(rng, (*shape[:-1], shape[-1] * NVFP4_BLOCK // 2), std)
        return {codes: values, name: scales, codes + NVFP4_GLOBAL: glob,
                codes + "_input_scale": rng.uniform(0.5, 2.0, shape[:1]) / 448.0}
    if s.checkpoint.decoded_in_kernel and name.endswith("_proj_blocks"):
        full = (shape[0], shape[1], shape[2] * MX_BLOCK)                  # [E, out, in]
        std = 1.0 / math.sqrt(full[-1]) * (residual_scale if name.endswith("down_proj_blocks") else 1.0)
        codes, scales = mxfp4_quantize(rng.normal(0.0, std, full).astype(np.float32))
        return {name: codes.reshape(shape), name.removesuffix("_blocks") + "_scales": scales}
    return None


@jax.jit
def _kernel_weighted_add(acc: jax.Array, weight: jax.Array, out: jax.Array) -> jax.Array:
    """``acc + weight * out`` as the kernel's expert loop adds one weighted expert (fused: one
    FMA; a multiply and an add apart round twice)."""
    return acc + weight * out


def expert_parallel_sum(rounding: Rounding, experts: int, dense: jax.Array, width: int,
                        expert: Callable[[int, slice], jax.Array], kind: str) -> jax.Array:
    """The routed experts as an expert-parallel kernel sums them: each rank (`rank_experts`: its
    group's experts, its width part ``cols`` of each) adds ``expert(e, cols)`` (``[B, width]``: expert
    e's output from its part of the expert) of each of its group's experts times the row's
    routing weight (``dense [B, E]``, `_kernel_route_weights`: 0 where the row did not pick it,
    and such an expert adds exactly nothing, as one the kernel skips), in expert-id order, one
    fused multiply-add each; the ranks' partial sums all-reduced as ``(kind,
    "routed_experts")``. Run on values, an expert no row picked is not computed (it would add
    zeros to a sum that is never -0)."""
    picked = None if isinstance(dense, jax.core.Tracer) else \
        set(np.flatnonzero(np.asarray(dense).any(axis=0)).tolist())
    partials = []
    for cols, mine in rank_experts(rounding, experts):
        acc = jnp.zeros((dense.shape[0], width), jnp.float32)
        for e in mine:
            if picked is None or e in picked:
                acc = _kernel_weighted_add(acc, dense[:, e:e + 1], expert(e, cols))
        partials.append(acc)
    return allreduce(partials, rounding.reduce(kind, "routed_experts"))


def rank_experts(rounding: Rounding, experts: int) -> list[tuple[slice, range]]:
    """Each rank's share of the routed experts, rank by rank: (its width part's columns, its
    group's expert ids). Rank r is in expert group ``r // expert_tp`` (experts ``group *
    local_experts ...``) and holds width part ``r % expert_tp`` (``expert_width`` columns)."""
    tp, part_width, local = (rounding.size(n) for n in ("expert_tp", "expert_width", "local_experts"))
    return [(slice(r % tp * part_width, (r % tp + 1) * part_width),
             range(r // tp * local, min((r // tp + 1) * local, experts))) for r in range(rounding.ranks)]


def _gate_first(s: MoE, w: jax.Array, axis: int) -> jax.Array:
    """An expert's gate|up axis with its gate entries first, then up's: as stored, or
    de-interleaved where the checkpoint alternates them (`gate_up_interleaved`)."""
    if not s.gate_up_interleaved:
        return w
    n = w.shape[axis]
    return jnp.concatenate([jax.lax.slice_in_dim(w, 0, n, 2, axis), jax.lax.slice_in_dim(w, 1, n, 2, axis)],
                           axis)


def mxfp4_experts(p: Mapping[str, jax.Array], matrix: str, ids: jax.Array) -> jax.Array:
    """The ``ids`` experts' ``matrix`` (``gate_up``, ``down``) decoded from an MXFP4
    checkpoint's ``*_blocks [E, out, in/32, 16]`` and ``*_scales [E, out, in/32]``:
    ``[..., out, in]`` f32, rows as stored."""
    blocks = jnp.asarray(p[f"experts.{matrix}_proj_blocks"])[ids].astype(jnp.uint8)
    codes = blocks.reshape(*blocks.shape[:-2], -1)               # 16 bytes a block, in order
    scales = jnp.asarray(p[f"experts.{matrix}_proj_scales"])[ids].astype(jnp.uint8)
    return mxfp4_dequantize_jax(codes, scales, (*ids.shape, *scales.shape[-2:-1], 2 * codes.shape[-1]))


def _picked(s: MoE, p: Mapping[str, jax.Array], d: Any, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The ``ids`` experts' ``gate_up [..., 2I, H]`` (gate rows first) and ``down [..., H, I]``
    values: decoded from MXFP4 codes, an FP8 checkpoint's codes times their block scales, an
    NVFP4 checkpoint's e2m1 x e4m3 values (their global scales apart: `_global_scaled`), or as
    stored."""
    if s.checkpoint is Checkpoint.MXFP4_PACKED:
        gate, up, down = (packed_experts(s, p, d, w, ids) for w in PACKED)
        return jnp.concatenate([gate, up], axis=-2), down
    if s.checkpoint.decoded_in_kernel:
        gate_up, down = (mxfp4_experts(p, m, ids) for m in EXPERTS)
    elif f"experts.gate_up_proj{NVFP4_SCALE}" in p:     # times their global scales after the dots
        gate_up, down = (nvfp4_unit_values(jnp.asarray(p[f"experts.{n}"])[ids],
                                           jnp.asarray(p[f"experts.{n}{NVFP4_SCALE}"])[ids])
                         for n in _STORED.values())
    else:
        gate_up, down = (w[ids] for w in expert_values(p, d))
    return _gate_first(s, gate_up, -2), down


def _global_scaled(p: Mapping[str, jax.Array], matrix: str, ids: jax.Array, y: jax.Array) -> jax.Array:
    """The picks' products ``y [..., k, out]`` of `matrix` (`gate_up`, `down`) times each pick's
    NVFP4 global scale, which multiplies its product of the e2m1 x e4m3 values (`_picked`); as
    they are for other experts."""
    name = f"experts.{_STORED[matrix]}{NVFP4_GLOBAL}"
    return y * jnp.asarray(p[name])[ids][..., None] if name in p else y


def activation(s: MoE, d: Any, gate: jax.Array, up: jax.Array) -> jax.Array:
    """An expert's activation of its gate and up products (`mkc.layers.moe.options.Activation`:
    ``silu(gate) * up``, or the clamped SwiGLU with the model's `swiglu_alpha` and
    `swiglu_limit`)."""
    return activate(s.activation, d, gate, up)


def _slot_expert(s: MoE, p: Mapping[str, jax.Array], d: Any, e: int, cols: slice, half: int,
                 values: bool = True) -> dict[str, jax.Array]:
    """Expert e's width part ``cols`` as its slot holds it, ``[out, in]``: gate_up's gate rows
    then its up rows (``[gate | up]``), down's input columns, each half padded with zeros to
    ``half`` (`MoE.expert_half`: MXFP4 halves are whole lane tiles), its biases likewise ([1,
    n]); an FP8 checkpoint's codes as they are (`expert_linear` scales them). Without
    `values` its biases only (experts whose every matrix is int4 or nvfp4: `four_bit_linear`)."""
    inter = d.moe_intermediate_size
    pad = half - (cols.stop - cols.start)
    w = {}
    if values:
        if s.checkpoint.decoded_in_kernel:
            gate_up, down = (mxfp4_experts(p, m, jnp.asarray(e)) for m in EXPERTS)
        else:
            gate_up, down = p["experts.gate_up_proj"][e], p["experts.down_proj"][e]
        gate_up = _gate_first(s, gate_up, 0).reshape(2, inter, -1)[:, cols]
        gate_up = jnp.pad(gate_up, ((0, 0), (0, pad), (0, 0))) if pad else gate_up
        w = {"gate_up": gate_up.reshape(2 * half, -1),
             "down": jnp.pad(down[:, cols], ((0, 0), (0, pad))) if pad else down[:, cols]}
    if s.expert_bias:
        bias = _gate_first(s, p["experts.gate_up_proj_bias"][e], 0).reshape(2, inter)[:, cols]
        w["gate_up_bias"] = jnp.pad(bias, ((0, 0), (0, pad))).reshape(1, 2 * half)
        w["down_bias"] = p["experts.down_proj_bias"][e][None, :]
    return w


def _routed_experts_per_rank(s: MoE, p: Mapping[str, jax.Array], d: Any, xin: jax.Array, dense: jax.Array,
                             rounding: Rounding, kind: str, ids: jax.Array) -> jax.Array:
    """The routed experts as an expert-parallel kernel computes them (module docstring,
    `expert_parallel_sum`; with the latent's `expert_norm`, `expert_parallel_picks` and
    `kernel_expert_norm`)."""
    tp, width, io = rounding.size("expert_tp"), rounding.size("expert_width"), s.expert_io(d)
    half = s.expert_half(d, tp)
    # FP8 experts: one mixed bf16 x fp8 dot a pack group, on the requantized values; an FP8
    # checkpoint's blocks (`fp8 block R x C`): one a group of rows under one block row, on its
    # codes, each partial product times its scales; MXFP4 experts: decoded a pack group at a
    # time; int4 and nvfp4 experts: `four_bit_linear`; bf16 experts: one bf16 dot.
    operands = {m: expert_operands(rounding, m, kind) for m in EXPERTS}
    formats = {m: rounding.weight_format(f"expert.{m}", kind) for m in EXPERTS}
    four_bit = {m for m in EXPERTS if getattr(formats[m], "name", "") in FOUR_BIT}
    fp8 = {m for m in EXPERTS if getattr(formats[m], "name", "") == "fp8"}
    blocks = {m for m in fp8 if formats[m].cols}
    grouped = fp8 | (set(EXPERTS) if s.checkpoint.decoded_in_kernel else set())
    rows = {m: s.pack_groups(d, tp)[m] if m in grouped else None for m in EXPERTS}
    rows |= {m: block_groups(formats[m], *{"gate_up": (io, width), "down": (width, io)}[m])[0]
             for m in blocks}

    def expert_linear(x: jax.Array, w: jax.Array, m: str, e: int, out_index: list[int],
                      in_index: list[int], runs: int) -> jax.Array:
        if m in four_bit:
            return four_bit_linear(rounding, p, x, f"experts.{_STORED[m]}", formats[m], e, out_index,
                                   in_index, s.pack_groups(d, tp)[m])
        scales = None
        if m in blocks:       # each row group's scale of each output column, [groups, out]
            block_rows, block_cols = block_index(formats[m], out_index, in_index, runs)
            grid = p[f"experts.{_STORED[m]}_scale_inv"][e]
            scales = grid[jnp.asarray(block_cols)][:, jnp.asarray(block_rows)].T
        elif f"experts.{_STORED[m]}{BLOCK_SCALE}" in p:     # `scale bf16`: [out, in/block]
            grid = jnp.asarray(p[f"experts.{_STORED[m]}{BLOCK_SCALE}"][e], jnp.float32)
            block = formats[m].block
            groups = [i // block for i in in_index[::rows[m]]]
            scales = grid[jnp.asarray(out_index)][:, jnp.asarray(groups)].T
        return rounding.linear(x, w, rows[m], operands[m], scales)

    def expert(e: int, cols: slice) -> jax.Array:
        # One dot of the rank's gate and up rows together, as its slot holds them ([gate |
        # up]): XLA's CPU f32 dot sums a 2 * width wide product in another order than two
        # width wide ones (module docstring).
        mine = list(range(cols.start, cols.stop))
        w = _slot_expert(s, p, d, e, cols, half, values=four_bit != set(EXPERTS))
        hidden = expert_linear(xin[:, :io], w.get("gate_up"), "gate_up", e,
                               mine + [d.moe_intermediate_size + i for i in mine], list(range(io)), width)
        if s.expert_bias:
            hidden = hidden + w["gate_up_bias"]
        gate, up = hidden[:, :half], hidden[:, half:]
        act = activate(s.activation, d, gate, up, kernel=True)
        out = expert_linear(act, w.get("down"), "down", e, list(range(io)), mine, io)
        return out + w["down_bias"] if s.expert_bias else out

    if s.latent and s.latent.expert_norm:
        outs = expert_parallel_picks(rounding, d.experts, ids, io, expert, kind)
        return kernel_expert_norm(outs, ids, dense, p[s.latent.expert_norm][None, :], d.post_norm_eps)
    return expert_parallel_sum(rounding, d.experts, dense, io, expert, kind)


def four_bit_linear(rounding: Rounding, p: Mapping[str, jax.Array], x: jax.Array, stored: str,
                    fmt: WeightFormat, e: int, out_index: list[int], in_index: list[int], group: int
                    ) -> jax.Array:
    """``x @`` expert e's fused matrix `stored` (its output rows `out_index`, input columns
    `in_index`: a rank's slice) in `fmt`, int4 or nvfp4, as the kernel multiplies it
    (`mkc.layers.expert_formats.reference`), pack groups of `group` rows: nvfp4 from the slot
    its packing fills (`mkc.layers.moe.weights.nvfp4_slot`); int4 from a requantization's
    codes and bf16 scales (`BLOCK_SCALE`, `weights.requantization`), or requantized here as
    packing requantizes it (`weights.int4_slot`)."""
    if fmt.name == "nvfp4":
        return nvfp4_linear(rounding, x, *nvfp4_slot(p, stored, e, out_index, in_index, fmt, stored), group)
    if stored + BLOCK_SCALE in p:
        blocks = [i // fmt.block for i in in_index[::fmt.block]]
        rows = np.asarray(p[stored][e])[np.ix_(out_index, in_index)]
        scales = np.asarray(p[stored + BLOCK_SCALE][e])[np.ix_(out_index, blocks)]
    else:
        rows, scales = unpack_int4_from_kernel(*int4_slot(p, stored, e, out_index, in_index, fmt, stored))
    return int4_linear(rounding, x, rows, scales, fmt.block, group)


def expert_parallel_picks(rounding: Rounding, experts: int, ids: jax.Array, width: int,
                          expert: Callable[[int, slice], jax.Array], kind: str) -> jax.Array:
    """Each row's picks' outputs side by side, ``[B, top_k * width]`` (pick j at columns ``j *
    width ...``), as the kernel forms them (`lowering._experts_per_pick`): each rank
    (`rank_experts`) puts ``expert(e, cols)``, its width part of expert e, where rows
    picked e, for each of its group's experts; the ranks' partials all-reduced as ``(kind,
    "routed_experts")``. Run on values, an expert no row picked is not computed."""
    top_k = ids.shape[-1]
    picked = None if isinstance(ids, jax.core.Tracer) else set(np.unique(np.asarray(ids)).tolist())
    partials = []
    for cols, mine in rank_experts(rounding, experts):
        acc = [jnp.zeros((ids.shape[0], width), jnp.float32) for _ in range(top_k)]
        for e in mine:
            if picked is not None and e not in picked:
                continue
            out = expert(e, cols)
            acc = [jnp.where(ids[:, j:j + 1] == e, out, acc[j]) for j in range(top_k)]
        partials.append(jnp.concatenate(acc, axis=-1))
    return allreduce(partials, rounding.reduce(kind, "routed_experts"))


@jax.jit
def _kernel_expert_norm(outs: jax.Array, ids: jax.Array, dense: jax.Array, w: jax.Array, eps: jax.Array
                        ) -> jax.Array:
    io, top_k = w.shape[-1], ids.shape[-1]
    lane = jax.lax.broadcasted_iota(jnp.int32, dense.shape, 1)
    scale = 1.0 + w
    acc = jnp.zeros((outs.shape[0], io), jnp.float32)
    for j in range(top_k):
        weight = jnp.sum(jnp.where(lane == ids[:, j:j + 1], dense, 0.0), axis=-1, keepdims=True)
        y = outs[:, j * io:(j + 1) * io] * scale
        acc = acc + weight * (y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps))
    return acc


def kernel_expert_norm(outs: jax.Array, ids: jax.Array, dense: jax.Array, w: jax.Array, eps: float
                       ) -> jax.Array:
    """The kernel's `expert_norm` (`mkc.layers.moe.lowering`) in its expression, jitted: each
    pick's all-reduced output ``outs [B, top_k * io]`` times ``1 + w`` (``w [1, io]``),
    RMS-normed (eps), times its routing weight (the lane of ``dense [B, E]`` its id picks),
    summed pick by pick (``ids [B, top_k]``)."""
    return _kernel_expert_norm(outs, jnp.asarray(ids, jnp.int32), dense, w, jnp.float32(eps))


_STORED = {"gate_up": "gate_up_proj", "down": "down_proj"}


# Kimi K3's per-expert checkpoint (`Checkpoint.MXFP4_PACKED`): gate, up and down as
# compressed-tensors MXFP4 (`weight_packed` e2m1 codes [out, in/2], `weight_scale` E8M0
# [out, in/32]); beside them a requantized checkpoint's bf16 block scales (`PACKED_BLOCK_SCALE`)
PACKED = ("w1", "w3", "w2")


def packed_shape(s: MoE, d: Any, matrix: str) -> tuple[int, int]:
    """Per-expert matrix `matrix`'s ``[out, in]`` in values."""
    io, inter = s.expert_io(d), d.moe_intermediate_size
    return (io, inter) if matrix == "w2" else (inter, io)


def packed_expert(s: MoE, p: Mapping[str, jax.Array], d: Any, e: int, matrix: str) -> jax.Array:
    """Expert e's `matrix` decoded to f32 ``[out, in]`` (its MXFP4 values, before any bf16 block
    scales)."""
    return mxfp4_dequantize_jax(jnp.asarray(p[f"experts.{e}.{matrix}.weight_packed"]).astype(jnp.uint8),
                                jnp.asarray(p[f"experts.{e}.{matrix}.weight_scale"]).astype(jnp.uint8),
                                packed_shape(s, d, matrix))


def packed_experts(s: MoE, p: Mapping[str, jax.Array], d: Any, matrix: str, ids: jax.Array) -> jax.Array:
    """The ``ids`` experts' `matrix` values ``[..., out, in]`` (times their bf16 block scales
    where the checkpoint has them), gathered while packed."""
    def stacked(name: str) -> jax.Array:
        return jnp.stack([jnp.asarray(p[f"experts.{e}.{matrix}.{name}"]) for e in range(d.experts)])[ids]
    shape = (*ids.shape, *packed_shape(s, d, matrix))
    values = mxfp4_dequantize_jax(stacked("weight_packed").astype(jnp.uint8),
                                  stacked("weight_scale").astype(jnp.uint8), shape)
    if f"experts.0.{matrix}.{PACKED_BLOCK_SCALE}" not in p:
        return values
    block_scales = stacked(PACKED_BLOCK_SCALE).astype(jnp.float32)
    return values * jnp.repeat(block_scales, shape[-1] // block_scales.shape[-1], axis=-1)


def _packed_experts_per_rank(s: MoE, p: Mapping[str, jax.Array], d: Any, xin: jax.Array, dense: jax.Array,
                             rounding: Rounding, kind: str, ids: jax.Array | None = None) -> jax.Array:
    """The per-expert checkpoint's routed experts as the kernel computes them
    (`expert_parallel_sum`): gate and up in a dot each, every matrix pack group by pack group,
    a requantized checkpoint's partial products times their bf16 block scales."""
    io, width = s.expert_io(d), rounding.size("expert_width")
    groups = pack_groups({"gate_up": io, "down": width})
    operands = {m: expert_operands(rounding, m, kind) for m in EXPERTS}
    lat = rounding.mm_in(xin)

    def per_group(e: int, m: str, w: jax.Array, group: int, rows: slice = slice(None),
                  cols: slice = slice(None)) -> jax.Array | None:
        """Matrix m's bf16 block scales (None: MXFP4's, already in its values) for its output
        `rows` and input `cols`, one row per pack group of `group` inputs: [in/group, out]."""
        scales = p.get(f"experts.{e}.{m}.{PACKED_BLOCK_SCALE}")
        if scales is None:
            return None
        block = w.shape[1] // scales.shape[1]
        cols = slice((cols.start or 0) // block, (cols.stop or w.shape[1]) // block)
        return jnp.repeat(jnp.asarray(scales, jnp.float32)[rows, cols], block // group, axis=1).T

    values = {e: [packed_expert(s, p, d, e, m) for m in PACKED] for e in range(d.experts)}

    def expert(e: int, cols: slice) -> jax.Array:
        (w1, w3, w2), gu, dn = values[e], groups["gate_up"], groups["down"]
        gate = rounding.linear(lat, w1[cols], gu, operands["gate_up"], per_group(e, "w1", w1, gu, cols))
        up = rounding.linear(lat, w3[cols], gu, operands["gate_up"], per_group(e, "w3", w3, gu, cols))
        return rounding.linear(activation(s, d, gate, up), w2[:, cols], dn, operands["down"],
                               per_group(e, "w2", w2, dn, cols=cols))

    return expert_parallel_sum(rounding, d.experts, dense, io, expert, kind)


def expert_values(p: Mapping[str, jax.Array], d: Any) -> tuple[jax.Array, jax.Array]:
    """The routed experts' fused ``gate_up_proj`` and ``down_proj`` values: as stored, an FP8
    checkpoint's codes times their block scales (`mkc.model.fp8_blocks.dequantize`), or codes'
    values times their bf16 block scales (`BLOCK_SCALE`)."""
    def values(n: str) -> jax.Array:
        if f"experts.{n}_scale_inv" in p:
            return dequantize(p[f"experts.{n}"], p[f"experts.{n}_scale_inv"], d.weight_block_size, jnp)
        if f"experts.{n}{BLOCK_SCALE}" in p:
            w, scale = jnp.asarray(p[f"experts.{n}"]), jnp.asarray(p[f"experts.{n}{BLOCK_SCALE}"])
            return w * jnp.repeat(scale, w.shape[-1] // scale.shape[-1], axis=-1)
        return p[f"experts.{n}"]
    return tuple(values(n) for n in _STORED.values())


def _shared_expert(s: MoE, p: Mapping[str, jax.Array], d: Any, x: jax.Array, rounding: Rounding | None,
                   kind: str) -> jax.Array:
    """The shared expert: a gated MLP of the experts' activation; with ``rounding`` its
    matrices are the schedule's ``shared_gate_up`` and ``shared_down`` of ``kind``, its width
    split over ranks in ``shared``-wide ranges."""
    return gated_mlp(p, x, rounding, kind, d, s.activation, ("shared_gate_up", "shared_down", "shared"))


def parts(s: MoE, p: Mapping[str, jax.Array], d: Any, x: jax.Array, rounding: Rounding | None,
          kind: str) -> tuple[jax.Array, jax.Array | None]:
    """The block's routed experts (summed; with `latent`, normed and projected back) and shared
    expert (before its gate; None without one), each all-reduced as the schedule says when
    ``rounding`` is given. ``p`` maps names relative to ``s.prefix`` to f32 arrays."""
    xin = mm_input(x, rounding)
    logits = router_logits(s, p, d, xin, rounding, kind)
    if s.router_bias:
        logits = logits + p[s.router_prefix + "bias"]
    if rounding is not None and (wire := rounding.exchange_wire(kind, "router")):
        logits = round_to(logits, wire)      # split between the cores of a chip, exchanged
    routing = route_args(s, p, d)
    ids, weights = route(logits, *routing)
    lat = s.latent
    if lat:
        xin = _gathered(matmul(xin, p[lat.down], rounding, kind, "latent_down", by_tiles=True),
                        rounding, kind, "latent_down")
        if lat.norm_at == "input":
            xin = NORM[lat.norm_weight](xin, p[lat.norm], d.rms_norm_eps)
    if rounding is None:
        routed = _routed_experts(s, p, d, xin, ids, weights)
    else:
        dense = _kernel_route_weights(logits, ids, routing[1], s.routing.scoring, s.routing.scaling(d))
        packed = s.checkpoint is Checkpoint.MXFP4_PACKED
        routed = (_packed_experts_per_rank if packed else _routed_experts_per_rank)(
            s, p, d, xin, dense, rounding, kind, ids)
    if lat:
        if lat.norm_at == "sum":
            routed = NORM[lat.norm_weight](routed, p[lat.norm], d.rms_norm_eps)
        routed = _gathered(matmul(routed, p[lat.up], rounding, kind, "latent_up", by_tiles=True),
                           rounding, kind, "latent_up")
    if not s.shared_expert:
        return routed, None
    shared = {n[len(s.shared_prefix):]: w for n, w in p.items() if n.startswith(s.shared_prefix)}
    return routed, _shared_expert(s, shared, d, x, rounding, kind)


def router_logits(s: MoE, p: Mapping[str, jax.Array], d: Any, xin: jax.Array, rounding: Rounding | None,
                  kind: str) -> jax.Array:
    """The router's logits of the (MXU-rounded) input: its weight's product, or with an f32
    weight (`Router.weight_pair`) the kernel's one product of its bf16 pair `[hi | lo]`
    (`router_pair`), the halves summed; times the router's factor (`Router.logit_scale`)."""
    w = p[s.router_prefix + "weight"]
    if s.routing.weight_pair and rounding is not None:
        pair = matmul(xin, router_pair(w), rounding, kind, "router", by_tiles=True)
        E = w.shape[0]
        logits = pair[:, :E] + pair[:, E:]
    else:
        logits = matmul(xin, w, rounding, kind, "router", by_tiles=True)
    scale = s.routing.logit_scale(d)
    return logits if scale is None else logits * scale


def router_pair(w: jax.Array) -> jax.Array:
    """An f32 weight ``[E, H]`` as two bf16 matrices' values stacked on the output axis,
    ``[hi; lo]`` (``[2E, H]``): hi the weight rounded to bf16, lo the remainder rounded
    (`mkc.layers.moe.weights.router_pair`: the same, in numpy)."""
    hi = jnp.asarray(w, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    lo = (jnp.asarray(w, jnp.float32) - hi).astype(jnp.bfloat16).astype(jnp.float32)
    return jnp.concatenate([hi, lo], axis=0)


def _gathered(y: jax.Array, rounding: Rounding | None, kind: str, op: str) -> jax.Array:
    """A projection whose columns are split over ranks, in the dtype its all-gather moves."""
    return y if rounding is None else round_to(y, rounding.gather_wire(kind, op))


def _routed_experts(s: MoE, p: Mapping[str, jax.Array], d: Any, xin: jax.Array, ids: jax.Array,
                    weights: jax.Array) -> jax.Array:
    """The f32 oracle's routed experts: each row's picks, weighted and summed."""
    inter = d.moe_intermediate_size
    gate_up, down = _picked(s, p, d, ids)
    hidden = _global_scaled(p, "gate_up", ids, jnp.einsum("bh,bkoh->bko", xin, gate_up, precision=HIGHEST))
    if s.expert_bias:
        hidden = hidden + _gate_first(s, p["experts.gate_up_proj_bias"][ids], -1)
    act = activation(s, d, hidden[..., :inter], hidden[..., inter:])
    out = _global_scaled(p, "down", ids, jnp.einsum("bki,bkoi->bko", act, down, precision=HIGHEST))
    if s.expert_bias:
        out = out + p["experts.down_proj_bias"][ids]
    if s.latent and s.latent.expert_norm:
        out = input_scaled_norm(out, p[s.latent.expert_norm], d.post_norm_eps)
    return jnp.einsum("bk,bko->bo", weights, out, precision=HIGHEST)


def route_args(s: MoE, p: Mapping[str, jax.Array], d: Any) -> tuple:
    """``route``'s arguments past the logits: its router's (`Router.route_args`)."""
    return s.routing.route_args(p, d)


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
    if not s.shared_gate:
        return routed + shared
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
    if not s.shared_gate:      # the kernel's x + routed + shared, left to right
        return resid + routed + shared
    return _kernel_mlp_residual(resid, routed, x, p["shared_expert_gate.weight"], shared)


def forward(s: MoE, lp: Mapping[str, jax.Array], d: Any, x: Any, cache: dict, layer: int,
            positions: jax.Array, rounding: Rounding | None, kind: str) -> Any:
    """The residual stream after the layer's MoE (its pre-norm, the block, the residual add);
    without `residual`, the residual strategy's stream with the block of its input left in it."""
    sub = {n[len(s.prefix):]: w for n, w in lp.items() if n.startswith(s.prefix)}
    if not s.residual:
        return x.leave(block(s, sub, d, x.h, rounding, kind))
    h = NORM[s.norm](x, lp["post_attention_layernorm.weight"], d.rms_norm_eps)
    return residual(s, sub, d, x, h, rounding, kind)


def block_shapes(s: MoE, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The block's upstream parameters under layer prefix `prefix` (`model.layers.{i}.`): the
    router's, the latent projections and norm (with `latent`), the routed experts in the
    checkpoint's layout (`Checkpoint.expert_tensors`: GPT-OSS's MXFP4 `*_blocks` hold two
    e2m1 codes a byte, low nibble first), the shared expert's."""
    H, E, inter, p, bf16 = d.hidden_size, d.experts, d.moe_intermediate_size, prefix + s.prefix, "bfloat16"
    shapes = {p + s.router_prefix + "weight": ((E, H), bf16),
              **({p + s.router_prefix + "bias": ((E,), bf16)} if s.router_bias else {}),
              **s.routing.checkpoint_tensors(d, p)}
    if s.routing.weight_pair:                # stored f32
        shapes[p + s.router_prefix + "weight"] = ((E, H), "float32")
    if s.latent:
        lat, names = s.expert_io(d), s.latent
        shapes |= {p + names.down: ((lat, H), bf16), p + names.norm: ((lat,), bf16),
                   p + names.up: ((H, lat), bf16),
                   **({p + names.expert_norm: ((lat,), bf16)} if names.expert_norm else {})}
    shapes |= s.layer_checkpoint(d, prefix).expert_tensors(p + "experts.", E, inter, s.expert_io(d),
                                                           s.expert_bias)
    if s.shared_expert:
        shared, q = d.shared_expert_intermediate_size, p + s.shared_prefix
        shapes |= {q + "gate_proj.weight": ((shared, H), bf16), q + "up_proj.weight": ((shared, H), bf16),
                   q + "down_proj.weight": ((H, shared), bf16),
                   **({p + "shared_expert_gate.weight": ((1, H), bf16)} if s.shared_gate else {})}
    return shapes


def param_shapes(s: MoE, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    return block_shapes(s, d, prefix) | own_norm(s, d, prefix + "post_attention_layernorm.weight")


def init_cache(s: MoE, d: Any, layer: int, batch: int, context: int, dtype: Any = None
               ) -> dict[str, jax.Array]:
    return {}

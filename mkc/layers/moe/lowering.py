"""The compute bodies of `MoE` (`op(s, c, *values)`, as `mkc.layers.gqa.lowering`'s), and the
kernel math of its routing; its experts' formats are `mkc.layers.expert_formats`'."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from mkc.layers import ops
from mkc.layers.expert_formats.lowering import expert_matmul
from mkc.layers.moe import MoE
from mkc.layers.moe.options import Router, ScaledSigmoid, Sigmoid, Softmax, TopKSoftmax
from mkc.runtime import experts as expert_slots
from mkc.runtime import pool
from mkc.runtime.context import Layer

F32 = jnp.float32
BF16 = jnp.bfloat16


def route_weights(logits: jax.Array, top_k: int, renormalise: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k routing per row -> (weights [B, E], ids [B, top_k] int32): weights is zero
    except at the picked experts, where it holds their softmax probabilities, divided by their
    sum when `renormalise`; ids lists the picks best first, ties to the lowest index
    (`mkc.runtime.experts.top_k`)."""
    probs = jax.nn.softmax(logits.astype(F32), axis=-1)
    kept, ids = expert_slots.top_k(probs, probs, top_k)
    return (kept / jnp.sum(kept, axis=-1, keepdims=True) if renormalise else kept), ids


def top_k_softmax_weights(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """GptOssTopKRouter on the logits ``[B, E]`` -> (weights ``[B, E]``, ids ``[B, top_k]``
    int32): the ``top_k`` largest logits, their softmax over those k only, placed at their
    lanes (zero elsewhere: upstream's ``router_scores``); ids best first, ties to the lowest
    lane (``mkc.runtime.experts.top_k``). The row max is the largest pick's logit, so
    ``exp(logit - max)`` over the picks is upstream's softmax of the k values."""
    scaled = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    kept, ids = expert_slots.top_k(logits, scaled, top_k)
    return kept / jnp.sum(kept, axis=-1, keepdims=True), ids


def sigmoid_route_weights(logits: jax.Array, bias: jax.Array, top_k: int, renormalise: bool = True,
                          scaling: float = 1.0, groups: int = 1, topk_groups: int = 1, eps: float = 0.0
                          ) -> tuple[jax.Array, jax.Array]:
    """Sigmoid top-k routing per row (DeepSeek-V3's, Kimi K3's) -> (weights [B, E], ids
    [B, top_k] int32): the experts picked by ``sigmoid(logits) + bias`` (bias [1, E], the
    correction bias: selection only), among the ``topk_groups`` best of ``groups`` groups
    (`group_limited`) when there are several; weights zero except at the picks, where they hold
    the sigmoid scores, divided by their sum (plus `eps`) when `renormalise`, times `scaling`. ids best
    first, ties to the lowest lane (`mkc.runtime.experts.top_k`)."""
    scores = jax.nn.sigmoid(logits)
    pick = scores + bias
    if groups > 1:
        pick = group_limited(pick, groups, topk_groups)
    kept, ids = expert_slots.top_k(pick, scores, top_k)
    if renormalise:
        total = jnp.sum(kept, axis=-1, keepdims=True)
        kept = kept / (total + eps if eps else total)
    return kept * scaling, ids


def group_limited(pick: jax.Array, groups: int, topk_groups: int) -> jax.Array:
    """``pick [B, E]`` with the experts outside each row's ``topk_groups`` best groups at
    -inf: the lanes split into ``groups`` consecutive groups, a group scored by the sum of its
    two largest values (a tie counts twice), the best groups taken by rounds of a max and the
    lowest group matching it. Lane masks and maxima on [B, 1] columns only (no gather, no
    lane reshape)."""
    n = pick.shape[1]
    lane = lax.broadcasted_iota(jnp.int32, pick.shape, 1)
    group = lax.div(lane, jnp.int32(n // groups))
    scores = []
    for g in range(groups):
        vals = jnp.where(group == g, pick, -jnp.inf)
        first = jnp.max(vals, axis=-1, keepdims=True)
        at = jnp.min(jnp.where(vals == first, lane, n), axis=-1, keepdims=True)
        second = jnp.max(jnp.where(lane == at, -jnp.inf, vals), axis=-1, keepdims=True)
        scores.append(first + second)
    chosen = [jnp.zeros_like(scores[0], dtype=jnp.bool_) for _ in range(groups)]
    for _ in range(topk_groups):
        left = [jnp.where(chosen[g], -jnp.inf, scores[g]) for g in range(groups)]
        best = left[0]
        for g in range(1, groups):
            best = jnp.maximum(best, left[g])
        taken = jnp.zeros_like(chosen[0])
        for g in range(groups):
            hit = (left[g] == best) & ~taken
            chosen[g], taken = chosen[g] | hit, taken | hit
    keep = jnp.zeros(pick.shape, jnp.bool_)
    for g in range(groups):
        keep = keep | ((group == g) & chosen[g])
    return jnp.where(keep, pick, -jnp.inf)


def _softmax_routing(r: Router, c: Layer, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    return route_weights(logits, c.dims.top_k, c.dims.norm_topk_prob)


def _top_k_softmax_routing(r: Router, c: Layer, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    return top_k_softmax_weights(logits, c.dims.top_k)


def _sigmoid_routing(r: Sigmoid, c: Layer, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    d, bias = c.dims, c.vector(r.bias)
    if logits.shape[-1] != d.experts:          # a split router's zero columns
        bias = bias[:, :d.experts]
        logits = logits[:, :d.experts]
    return sigmoid_route_weights(logits, bias, d.top_k, r.renormalise(d), r.scaling(d),
                                 getattr(d, "n_group", 1), getattr(d, "topk_group", 1), r.eps)


# Each router's kernel routing, by its type (`mkc.layers.moe.options`): (router, layer, logits)
# -> (weights [B, E], ids [B, top_k])
KERNEL_ROUTING: dict[type[Router], Callable[..., tuple[jax.Array, jax.Array]]] = {
    Softmax: _softmax_routing, TopKSoftmax: _top_k_softmax_routing,
    Sigmoid: _sigmoid_routing, ScaledSigmoid: _sigmoid_routing,
}


def _expert_bias(c: Layer, k, name: str) -> jax.Array:
    """Selected expert k's bias row `name` ([1, n] bf16 in its slot) as f32."""
    es = c.experts
    row, rows, cols = expert_slots.matrix(es, c.refs, k, name)
    return pool.pooled_bf16(getattr(c.refs, es.pool), row, rows, cols).astype(F32)


def post_norm(s: MoE, c: Layer) -> jax.Array:
    return ops.pre_norm(s.norm, c, "post_norm")


def _own_cols(c: Layer, name: str) -> int | None:
    """A streamed matrix's own columns (its ring tiles pad them); None for a pooled one, whose
    product is as wide as the matrix."""
    streamed = c.plan.streamed.get(name)
    return streamed[1].cols if streamed else None


def router(s: MoE, c: Layer, h: jax.Array) -> jax.Array:
    """The logits of every expert, or of this rank's share of a split router (its columns);
    an f32 weight's bf16 pair summed (`Router.weight_pair`: one dot of `[hi | lo]`), the
    router's factor on them (`Router.logit_scale`: Muse Spark's `output_multiplier`)."""
    E = c.dims.experts
    if s.routing.weight_pair:
        pair = c.matmul("router", h)
        logits = pair[:, :E] + pair[:, E:2 * E]
    else:
        logits = c.matmul("router", h)[:, :_own_cols(c, "router") if s.router_split else E]
    if (scale := s.routing.logit_scale(c.dims)) is not None:
        logits = logits * scale
    return logits + c.vector("router_bias") if s.router_bias else logits


def route(s: MoE, c: Layer, router_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The router's picks (`KERNEL_ROUTING`: softmax top-k, the top k's softmax, sigmoid
    top-k); this rank's picked local experts go to SMEM for their copies."""
    weights, ids = KERNEL_ROUTING[type(s.routing)](s.routing, c, router_logits)
    c.select_experts(ids)
    return ids, weights


def latent_down(s: MoE, c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("latent_down", h)[:, :_own_cols(c, "latent_down")]


def shared_gate_up(s: MoE, c: Layer, h: jax.Array) -> jax.Array:
    return ops.activation(s.activation, c.matmul("shared_gate_up", h), c.per_rank["shared"], c.dims)


def shared_down(s: MoE, c: Layer, shared_act: jax.Array) -> jax.Array:
    return c.matmul("shared_down", shared_act)[:, :c.dims.hidden_size]


def routed_experts(s: MoE, c: Layer, h: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array
                   ) -> jax.Array:
    """This rank's picked experts on every row, each `down(act(gate_up h (+ b))) (+ b)`
    weighted by its routing weight (zero for rows that did not pick it), summed in ascending
    expert order: a partial sum over ranks. `h`: the normed input, or the gathered latent
    (its first `expert_io` columns); with the latent's `expert_norm`, each pick's output apart
    (`_experts_per_pick`)."""
    groups = c.per_rank
    width = groups["expert_half"] if s.checkpoint.decoded_in_kernel else groups["expert_width"]
    io = s.expert_io(c.dims)
    if s.latent:
        h = h[:, :io]
    if s.latent and s.latent.expert_norm:
        return _experts_per_pick(s, c, h, expert_ids, width)

    def expert(k, acc):
        gate_up = expert_matmul(c, k, h, "gate_up", groups["gate_up_group"])
        if s.expert_bias:
            gate_up = gate_up + _expert_bias(c, k, "gate_up_bias")
        act = ops.activation(s.activation, gate_up, width, c.dims)
        if not s.expert_bias:
            return acc + c.expert_weight(expert_weights, k) * expert_matmul(c, k, act, "down",
                                                                             groups["down_group"])
        out = expert_matmul(c, k, act, "down", groups["down_group"]) + _expert_bias(c, k, "down_bias")
        return acc + c.expert_weight(expert_weights, k) * out

    return c.fold_experts(expert, jnp.zeros((c.B, io), F32))


def _experts_per_pick(s: MoE, c: Layer, h: jax.Array, expert_ids: jax.Array, width: int) -> jax.Array:
    """This rank's picked experts' outputs `down(act(gate_up h))` (its width part of each: a
    partial over the ranks), each placed where rows picked it: pick j of a row at columns
    `j * io ...` of `[B, top_k * io]` (the kernel's one-hot of `expert_ids`' column j, lane
    masked for selected expert k: `c.expert_weight`), zero elsewhere. The picks gather in the
    VMEM activation `picks` (`MoE.activations`), not a loop carry: a carry of top_k * io f32
    columns a row is hundreds of vector registers, which libtpu spills and reloads every
    expert."""
    groups, io, E = c.per_rank, s.expert_io(c.dims), c.dims.experts
    lane = lax.broadcasted_iota(jnp.int32, (c.B, E), 1)
    picks = [(lane == expert_ids[:, j:j + 1]).astype(F32) for j in range(c.dims.top_k)]
    out_ref = c.refs.picks
    out_ref[...] = jnp.zeros(out_ref.shape, F32)

    def expert(k, carry):
        act = ops.activation(s.activation, expert_matmul(c, k, h, "gate_up", groups["gate_up_group"]), width,
                             c.dims)
        out = expert_matmul(c, k, act, "down", groups["down_group"])
        for j, pick in enumerate(picks):
            cols = slice(j * io, (j + 1) * io)
            out_ref[:, cols] = jnp.where(c.expert_weight(pick, k) > 0, out, out_ref[:, cols])
        return carry

    c.fold_experts(expert, jnp.int32(0))
    return out_ref[...]


def expert_norm(s: MoE, c: Layer, expert_outs: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array
                ) -> jax.Array:
    """Each pick's output (all-reduced) input-scaled RMS-normed, ``y * (1 + w)`` then
    ``* rsqrt(mean(.^2) + post_norm_eps)`` (upstream's `post_expert_norm`, one weight for every
    expert), times the pick's routing weight (its lane of `expert_weights`), summed pick by
    pick."""
    io, E = s.expert_io(c.dims), c.dims.experts
    scale = 1.0 + c.vector("expert_norm")
    lane = lax.broadcasted_iota(jnp.int32, (c.B, E), 1)
    acc = jnp.zeros((c.B, io), F32)
    for j in range(c.dims.top_k):
        weight = jnp.sum(jnp.where(lane == expert_ids[:, j:j + 1], expert_weights[:, :E], 0.0), axis=-1,
                         keepdims=True)
        normed = ops.rms_norm_weightless(expert_outs[:, j * io:(j + 1) * io] * scale, c.dims.post_norm_eps)
        acc = acc + weight * normed
    return acc


def latent_norm(s: MoE, c: Layer, latent: jax.Array) -> jax.Array:
    """The latent's RMS norm (`Latent.norm_weight`): the experts' sum (Kimi K3's), or the
    gathered projected input's first `expert_io` columns (Muse Spark's, before the experts),
    in f32 (the gather lands in its wire dtype)."""
    if s.latent.norm_at == "input":
        latent = latent[:, :s.expert_io(c.dims)].astype(F32)
    return ops.NORM[s.latent.norm_weight](latent, c.vector("latent_norm"), c.dims.rms_norm_eps)


def latent_up(s: MoE, c: Layer, routed_out: jax.Array) -> jax.Array:
    return c.matmul("latent_up", routed_out)[:, :_own_cols(c, "latent_up")]


def mlp_residual(s: MoE, c: Layer, *values: jax.Array) -> None:
    """x += routed (+ sigmoid(h . shared_gate) * shared, the gate's input rounded to bf16, as
    the MXU would take it; or + shared, ungated): values are (shared_out, routed_out, h) with a
    gated shared expert, (shared_out, routed_out) with an ungated one, else (routed_out,). With
    a latent, routed_out is latent_up's gathered product: its padded shares cut to the hidden
    size."""
    if not s.shared_expert:
        (routed_out,) = values
        if s.latent:
            routed_out = routed_out[:, :c.dims.hidden_size]
        c.refs.x[...] = c.refs.x[...] + routed_out
        return
    if not s.shared_gate:
        shared_out, routed_out = values
        c.refs.x[...] = c.refs.x[...] + routed_out + shared_out
        return
    shared_out, routed_out, h = values
    hb = h.astype(BF16).astype(F32)
    gate = jax.nn.sigmoid(jnp.sum(hb * c.vector("shared_gate"), axis=-1, keepdims=True))
    c.refs.x[...] = c.refs.x[...] + routed_out + gate * shared_out

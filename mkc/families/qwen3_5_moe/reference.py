"""Pure-JAX reference decode for the Hugging Face ``qwen3_5_moe_text`` family (Qwen3.5 MoE, e.g.
Qwen3.5-35B-A3B), one decode token per row.

It follows upstream transformers ``models/qwen3_5_moe/modeling_qwen3_5_moe.py``
(``Qwen3_5MoeForCausalLM``; read from the stored copy of huggingface/transformers ``main``).
Everything but the MLP is Qwen3.5's, and is imported from ``mkc.families.qwen3_5.reference``
rather than rewritten: the gated delta net (``linear_attention_block``), the gated attention
(``full_attention_block``), the zero-centred norms, the embedding, the decode state
(``init_cache``) and its layouts, and the mixers' rounding emulation; that module's docstring
states their math. What is new here is the sparse MoE block and the parameter table.

MoE block (``Qwen3_5MoeSparseMoeBlock``), in every layer, on the post-attention-normed
``x [B, H]``, all in f32 with ``Precision.HIGHEST`` dots:

* router (``mlp.gate``, ``Qwen3_5MoeTopKRouter``): ``logits = x @ gate.weight^T`` (``[E, H]``, no
  bias); ``probs = softmax(logits)`` over all E experts; the ``num_experts_per_tok`` largest;
  their weights divided by their sum (``norm_topk_prob``: upstream always renormalises, the
  config reader refuses ``false``; the flag exists so tests can show what it changes). Upstream
  then casts the weights to the activations' dtype (bf16 in a bf16 model); this f32 oracle
  keeps them f32, as it keeps every activation f32;
* routed expert e (``mlp.experts``, ``Qwen3_5MoeExperts``, stored fused): ``gate_up_proj[e]``
  ``[2I, H]`` holds the gate rows ``0..I-1`` then the up rows ``I..2I-1`` (upstream chunks the
  product in two along its output axis); ``expert_e(x) = down_proj[e] @ (silu(gate) * up)``
  with ``down_proj[e]`` ``[H, I]``;
* shared expert (``mlp.shared_expert``): a SwiGLU MLP of width ``shared_expert_intermediate_size``
  (Qwen3.5's dense ``mlp_block``), times ``sigmoid(x @ shared_expert_gate.weight^T)`` (``[1, H]``);
* output: ``sum_k w_k expert_{id_k}(x) + sigmoid(...) * shared(x)``.

Parameter names (``param_shapes``) are upstream's ``Qwen3_5MoeForCausalLM`` ones, per layer
``model.layers.{i}.mlp.``: ``gate.weight [E, H]``, ``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``, ``shared_expert.{gate,up}_proj.weight [S, H]``,
``shared_expert.down_proj.weight [H, S]``, ``shared_expert_gate.weight [1, H]``. The fused expert
tensors are what the modeling file declares; that the published BF16 checkpoint stores them so
(under ``model.language_model.``, 693 text tensors for the 35B, as this table has) was
established from third-party manifests of its safetensors, not from the Hub files themselves.
A checkpoint with per-expert tensors (``mlp.experts.{e}.gate_proj.weight`` ..., the Qwen2/3-MoE
layout, which transformers fuses through its ``qwen2_moe`` conversion mapping on load and writes
back on ``save_pretrained``) loads too: ``mkc.checkpoint`` fuses them into this table's tensors
(the family's ``EXPERT_LAYOUTS``, ``config.py``).

Kernel rounding emulation (``rounding``, as in the Qwen3.5 reference): the mixers round as
Qwen3.5's do (layer kinds ``gdn`` and ``gqa``). In the MoE block (kind ``moe``) every matmul
takes bf16 activations; the routed experts become per-rank partial sums: rank r belongs to
expert group ``r // expert_tp`` (experts ``group * local_experts ...`` in id order) and holds
width slice ``r % expert_tp`` (``expert_width`` columns) of each, its gate and up columns
multiplied in one dot, as the kernel's slot holds them (``[gate | up]``: XLA's CPU f32 dot,
which the FP8 experts' mixed dots are, sums a 256-wide product in another order than two
128-wide ones; measured, ``mkc.numerics``); it adds each expert's output times the row's
routing weight (0 where the row did not pick it) in expert-id order, one fused multiply-add
each, and the partials are all-reduced as ``(kind, "routed_experts")``; the
routing weights are the kernel's: the picked softmax probabilities over all E lanes, zero
elsewhere, divided by their lane sum (``_kernel_route_weights``). The shared expert is
Qwen3.5's dense MLP emulation (``shared`` columns per rank, all-reduced as
``(kind, "shared_down")``). The block is added to the residual stream as the kernel's
``mlp_residual`` adds it (``moe_residual``): the routed sum first, then the shared expert
times its sigmoid gate, a lane sum of the bf16 input times the gate vector. Each of these is
written in the kernel's expression and shapes, jitted, since XLA's f32 order depends on both
(``mkc.numerics``: measured at batch 8, where the sums over the k picks and the block's own
sum were off).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.families.kimi_k3.graph import expert_pack_groups as pack_groups
from mkc.families.kimi_k3.reference import _expert_operands
from mkc.families.qwen3_5 import reference as qwen
from mkc.families.qwen3_5.reference import (FULL, LINEAR, Qwen35Config, embed,
                                            init_cache, linear,
                                            mlp_block, rms_norm)
from mkc.families.qwen3_5_moe.config import MODEL_TYPES, read_dims
from mkc.model.config import in_range, upstream_config
from mkc.reference.rounding import Rounding, allreduce, bf16_weights

# The layer-loop kind of the MoE sublayer: the schedule's all-reduces of its ops live there.
MOE_KIND = "moe"

__all__ = ["FULL", "LINEAR", "Qwen35MoeConfig", "count_parameters", "decode_hidden",
           "decode_step", "embed", "init_cache", "init_params", "load_config", "moe_block",
           "moe_residual", "param_shapes", "route"]

_HIGHEST = jax.lax.Precision.HIGHEST

@dataclass(frozen=True)
class Qwen35MoeConfig(Qwen35Config):
    """A Qwen3.5 config (the mixers' fields, which the imported blocks read) plus the MoE's.

    ``intermediate_size`` is always 0: there is no dense MLP (upstream's MoE config has no such
    key). Hashable, so it can be a static jit argument."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True


def load_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> Qwen35MoeConfig:
    """The config of a qwen3_5_moe_text model (dict, config.json path, or checkpoint directory;
    a composite ``qwen3_5_moe`` config's ``text_config``), read by the family's one config
    reader (``config.read_dims``: upstream ``Qwen3_5MoeTextConfig`` defaults for omitted keys,
    ConfigError, a ValueError with its hint, for settings mkc does not compute)."""
    raw, name = upstream_config(path_or_dict)
    model_type = raw.get("model_type", MODEL_TYPES[0])
    if model_type not in MODEL_TYPES:
        raise ValueError(f"expected model_type {MODEL_TYPES[0]!r}, got {model_type!r}")
    dims = in_range(read_dims(raw, name))
    mixers = qwen.config_of(dims, intermediate_size=0)
    return Qwen35MoeConfig(
        **{f.name: getattr(mixers, f.name) for f in dataclasses.fields(mixers)},
        num_experts=dims.experts, num_experts_per_tok=dims.top_k,
        moe_intermediate_size=dims.moe_intermediate_size,
        shared_expert_intermediate_size=dims.shared_expert_intermediate_size,
    )


def _moe_shapes(cfg: Qwen35MoeConfig, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """One layer's MoE parameters, in upstream module order, names under ``prefix`` (``...mlp.``)."""
    h, e = cfg.hidden_size, cfg.num_experts
    inter, shared = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    bf16 = "bfloat16"
    return {
        prefix + "gate.weight": ((e, h), bf16),
        prefix + "experts.gate_up_proj": ((e, 2 * inter, h), bf16),
        prefix + "experts.down_proj": ((e, h, inter), bf16),
        prefix + "shared_expert.gate_proj.weight": ((shared, h), bf16),
        prefix + "shared_expert.up_proj.weight": ((shared, h), bf16),
        prefix + "shared_expert.down_proj.weight": ((h, shared), bf16),
        prefix + "shared_expert_gate.weight": ((1, h), bf16),
    }


def param_shapes(cfg: Qwen35MoeConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every HF parameter name of ``Qwen3_5MoeForCausalLM`` -> (PyTorch shape, dtype name).

    The Qwen3.5 table with each layer's dense MLP replaced by the MoE block's parameters."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, spec in qwen.param_shapes(cfg).items():
        layer, sep, rest = name.partition(".mlp.")
        if not sep:
            shapes[name] = spec
        elif rest == "gate_proj.weight":   # the first of the dense MLP's three: the MoE goes here
            shapes |= _moe_shapes(cfg, layer + sep)
    return shapes


def init_params(cfg: Qwen35MoeConfig, seed: int) -> dict[str, np.ndarray]:
    """Random bf16 parameters keeping the residual stream and logits O(1).

    Every parameter Qwen3.5 has comes from the Qwen3.5 reference's ``init_params`` (same rules);
    the MoE's are N(0, 1/fan_in) from a stream of their own, the matrices writing into the
    residual stream (``experts.down_proj``, ``shared_expert.down_proj``) further scaled by
    1/sqrt(2 * layers). The router then spreads each row over several experts."""
    mixers = qwen.init_params(dataclasses.replace(cfg, intermediate_size=1), seed)
    rng = np.random.default_rng([seed, 1])
    residual_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for name, (shape, _) in param_shapes(cfg).items():
        if ".mlp." not in name:
            out[name] = mixers[name]
            continue
        std = 1.0 / math.sqrt(shape[-1])
        if name.endswith(("experts.down_proj", "shared_expert.down_proj.weight")):
            std *= residual_scale
        out[name] = bf16_weights(rng.normal(0.0, std, shape))
    return out


def count_parameters(cfg: Qwen35MoeConfig, active: bool = False) -> int:
    """Parameters of ``param_shapes``; ``active``: those one decode token reads, i.e. without the
    ``E - top_k`` routed experts it does not pick and without all but one embedding row."""
    total = 0
    for name, (shape, _) in param_shapes(cfg).items():
        n = math.prod(shape)
        if active and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            n = n // cfg.num_experts * cfg.num_experts_per_tok
        elif active and name == "model.embed_tokens.weight":
            n = cfg.hidden_size
        total += n
    return total


# ---------------------------------------------------------------------------------------------
# The MoE block (public so tests can check it in isolation).


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


def _mm_input(x: jax.Array, rounding: Rounding | None) -> jax.Array:
    return x if rounding is None else rounding.mm_in(x)


@jax.jit
def _kernel_route_weights(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Routing weights over every expert ``[B, E]`` as the kernel forms them
    (``mkc.families.qwen3_5_moe.ops.route``), jitted: the softmax probabilities of the picked
    ``ids`` (zero elsewhere) divided by their sum over all E lanes. Their sum over the k picks
    (``route``) adds the same values in another f32 order: a weight one ulp apart flips a bf16
    wire rounding of the routed experts' all-reduce (measured, batch 8: 2.4e-4 in one row's
    MoE output, 1.2e-4 in its logits)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    rows = jnp.arange(logits.shape[0])[:, None]
    kept = jnp.zeros_like(probs).at[rows, ids].set(jnp.take_along_axis(probs, ids, axis=-1))
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


@jax.jit
def _kernel_weighted_add(acc: jax.Array, weight: jax.Array, out: jax.Array) -> jax.Array:
    """``acc + weight * out`` as the kernel's expert loop adds one weighted expert (fused: one
    FMA; a multiply and an add apart round twice)."""
    return acc + weight * out


def _routed_experts_per_rank(p: Mapping[str, jax.Array], cfg: Qwen35MoeConfig, xin: jax.Array,
                             dense: jax.Array, rounding: Rounding, kind: str) -> jax.Array:
    """The routed experts as an expert-parallel kernel computes them (module docstring): each
    rank's part of its group's experts on every row, weighted by the row's routing weight
    (``dense [B, E]``, ``_kernel_route_weights``: 0 where not picked, and such an expert adds
    exactly nothing, as one the kernel skips), summed in expert-id order, the ranks' partial
    sums all-reduced."""
    b, inter = xin.shape[0], cfg.moe_intermediate_size
    tp, width, local = (rounding.size(n) for n in ("expert_tp", "expert_width", "local_experts"))
    gate_up, down = p["experts.gate_up_proj"], p["experts.down_proj"]
    # FP8 experts: one mixed bf16 x fp8 dot a pack group (K3's rule), on the requantized values
    # the caller passes (the module's `requantized_weights`); bf16 experts: one bf16 dot.
    operands = {m: _expert_operands(rounding, m) for m in ("gate_up", "down")}
    fp8 = {m for m in ("gate_up", "down")
           if getattr(rounding.weight_format(f"expert.{m}"), "name", "") == "fp8"}
    rows = {m: pack_groups(cfg.hidden_size, inter)[m] if m in fp8 else None
            for m in ("gate_up", "down")}

    def linear(x: jax.Array, w: jax.Array, m: str) -> jax.Array:
        return rounding.linear(x, w, rows[m], operands[m])

    partials = []
    for r in range(rounding.ranks):
        group, part = r // tp, r % tp
        cols = slice(part * width, (part + 1) * width)
        acc = jnp.zeros((b, cfg.hidden_size), jnp.float32)
        for e in range(group * local, min((group + 1) * local, cfg.num_experts)):
            # One dot of the rank's gate and up rows together, as its slot holds them
            # ([gate | up]): XLA's CPU f32 dot sums a 2 * width wide product in another order
            # than two width wide ones (module docstring).
            fused = gate_up[e].reshape(2, inter, -1)[:, cols].reshape(2 * width, -1)
            hidden = linear(xin, fused, "gate_up")
            act = jax.nn.silu(hidden[:, :width]) * hidden[:, width:]
            acc = _kernel_weighted_add(acc, dense[:, e:e + 1], linear(act, down[e][:, cols], "down"))
        partials.append(acc)
    return allreduce(partials, rounding.reduce(kind, "routed_experts"))


def _moe_parts(p: Mapping[str, jax.Array], cfg: Qwen35MoeConfig, x: jax.Array,
               rounding: Rounding | None, kind: str) -> tuple[jax.Array, jax.Array]:
    """The MoE block's routed experts (summed) and shared expert (before its gate), each
    all-reduced as the schedule says when ``rounding`` is given."""
    inter = cfg.moe_intermediate_size
    xin = _mm_input(x, rounding)
    router = qwen._linear(xin, p["gate.weight"], rounding)
    ids, weights = route(router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    if rounding is None:
        hidden = jnp.einsum("bh,bkoh->bko", xin, p["experts.gate_up_proj"][ids], precision=_HIGHEST)
        act = jax.nn.silu(hidden[..., :inter]) * hidden[..., inter:]
        out = jnp.einsum("bki,bkoi->bko", act, p["experts.down_proj"][ids], precision=_HIGHEST)
        routed = jnp.einsum("bk,bko->bo", weights, out, precision=_HIGHEST)
    else:
        if not cfg.norm_topk_prob:
            raise ValueError("the kernel always renormalises its routing weights "
                             "(norm_topk_prob): no emulation without it")
        routed = _routed_experts_per_rank(p, cfg, xin, _kernel_route_weights(router, ids),
                                          rounding, kind)
    shared = {n[len("shared_expert."):]: w for n, w in p.items() if n.startswith("shared_expert.")}
    return routed, _shared_expert(shared, x, rounding, kind)


@jax.jit
def _kernel_mlp_residual(resid: jax.Array, routed: jax.Array, h: jax.Array, gate_w: jax.Array,
                         shared: jax.Array) -> jax.Array:
    """The residual stream after the MoE block as the kernel's ``mlp_residual`` adds it, jitted:
    ``resid + routed`` first, then the gated shared expert (fused: one FMA), the gate
    ``sigmoid`` of a lane sum of the bf16-rounded ``h`` times ``gate_w [1, H]`` (not a dot).
    Adding the block's sum ``routed + gate * shared`` instead is an ulp or two off in most
    rows (measured, batch 8: every row of every MoE layer's output)."""
    hb = h.astype(jnp.bfloat16).astype(jnp.float32)
    gate = jax.nn.sigmoid(jnp.sum(hb * gate_w, axis=-1, keepdims=True))
    return resid + routed + gate * shared


def moe_block(p: Mapping[str, jax.Array], cfg: Qwen35MoeConfig, x: jax.Array,
              rounding: Rounding | None = None, kind: str = "") -> jax.Array:
    """Qwen3_5MoeSparseMoeBlock for the normed ``x [B, H]``; ``p`` maps names relative to
    ``mlp.`` (e.g. ``"experts.gate_up_proj"``) to f32 arrays. With ``rounding``, ``kind`` is the
    layer kind (``gdn``/``gqa``) whose MoE all-reduces apply. (The emulation adds the block to
    the residual stream as the kernel does: ``moe_residual``.)"""
    routed, shared = _moe_parts(p, cfg, x, rounding, kind)
    gate = jax.nn.sigmoid(linear(_mm_input(x, rounding), p["shared_expert_gate.weight"]))   # [B, 1]
    return routed + gate * shared


def moe_residual(p: Mapping[str, jax.Array], cfg: Qwen35MoeConfig, resid: jax.Array,
                 x: jax.Array, rounding: Rounding | None = None, kind: str = "") -> jax.Array:
    """The residual stream ``resid`` after the MoE block of the normed ``x`` (``moe_block``):
    plainly ``resid + moe_block(...)``; with ``rounding`` in the kernel's order
    (``_kernel_mlp_residual``)."""
    if rounding is None:
        return resid + moe_block(p, cfg, x)
    routed, shared = _moe_parts(p, cfg, x, rounding, kind)
    return _kernel_mlp_residual(resid, routed, x, p["shared_expert_gate.weight"], shared)


def _shared_expert(p: Mapping[str, jax.Array], x: jax.Array, rounding: Rounding | None,
                   kind: str) -> jax.Array:
    """The shared expert: Qwen3.5's SwiGLU MLP; with ``rounding`` its down projection is the
    schedule's ``shared_down`` of ``kind``, split over ranks in ``shared``-wide ranges."""
    if rounding is None:
        return mlp_block(p, x)
    act = jax.nn.silu(rounding.linear(x, p["gate_proj.weight"])) * rounding.linear(x, p["up_proj.weight"])
    return qwen._out_projection(act, p["down_proj.weight"], rounding, kind, "shared_down",
                                rounding.size("shared"), "mlp")


# ---------------------------------------------------------------------------------------------
# Whole model


def decode_hidden(params: Mapping[str, Any], cfg: Qwen35MoeConfig, cache: Mapping[str, jax.Array],
                  tokens: jax.Array, positions: jax.Array, rounding: Rounding | None = None
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Qwen3.5's decoder layers with the MoE block as each layer's MLP."""
    return qwen.decode_hidden(
        params, cfg, cache, tokens, positions, rounding,
        mlp_residual=lambda p, cfg, resid, x, rounding, kind: moe_residual(p, cfg, resid, x, rounding,
                                                                           MOE_KIND))


def decode_step(params: Mapping[str, Any], cfg: Qwen35MoeConfig, cache: Mapping[str, jax.Array],
                tokens: jax.Array, positions: jax.Array, rounding: Rounding | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One decode token per row: (logits f32 ``[B, vocab]``, new cache).

    jit with ``jax.jit(decode_step, static_argnums=(1, 5))``; ``params`` may be numpy bf16
    arrays. ``rounding`` switches on the kernel rounding emulation (module docstring)."""
    x, new_cache = decode_hidden(params, cfg, cache, tokens, positions, rounding)
    x = rms_norm(x, jnp.asarray(params["model.norm.weight"]).astype(jnp.float32), cfg.rms_norm_eps)
    head = params["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    return qwen._linear(x, jnp.asarray(head).astype(jnp.float32), rounding), new_cache

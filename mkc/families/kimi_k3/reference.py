"""Pure-JAX reference decode for Kimi K3 (hybrid KDA / gated-MLA, latent MoE, attention residuals).

The oracle the Kimi megakernels are checked against: it shares no code with them and favours
plain math over speed. Every activation is f32 and every dot uses ``Precision.HIGHEST``; bf16
weights are upcast and the MXFP4 routed experts are decoded exactly (``mkc.model.mxfp4``).

Sources. Parameter names and equations follow the released checkpoint contract as read by the
public hand-written megakernel ``Inferact/tpu-megakernels`` (``kimi/__init__.py``,
``kimi/load.py``, ``kimi/decode_megakernel.py``), and, for names it inherits, upstream Kimi Linear
(``modeling_kimi.py``: KDA, MLA, ``block_sparse_moe``). The released checkpoint nests the text
tower under ``language_model.`` (``language_model.model.layers...``,
``language_model.lm_head.weight``); names here are the text-only ``model.`` / ``lm_head.`` ones.

Config keys (``load_config``; HF style, a composite config's ``text_config`` is used):
``hidden_size, vocab_size, num_hidden_layers, intermediate_size`` (layer 0's dense MLP),
``rms_norm_eps``, ``tie_word_embeddings`` (false); ``hidden_act: "situ"`` with ``activation_situ_beta`` (4)
and ``activation_situ_linear_beta`` (25); MLA: ``num_attention_heads, q_lora_rank, kv_lora_rank,
qk_nope_head_dim, qk_rope_head_dim`` (the shared extra key dims, no RoPE under
``mla_use_nope``), ``v_head_dim, mla_use_output_gate``; MoE: ``num_experts,
num_experts_per_token, num_shared_experts, moe_intermediate_size, routed_expert_hidden_size``
(the latent width), ``first_k_dense_replace, moe_layer_freq, moe_router_activation_func,
moe_renormalize, routed_scaling_factor, num_expert_group, latent_moe_use_norm``; residuals:
``attn_res_block_size``; KDA: ``linear_attn_config = {num_heads, head_dim,
short_conv_kernel_size, gate_lower_bound, use_full_rank_gate, full_attn_layers, kda_layers}``
where the two layer lists are 1-based, as upstream Kimi Linear.

Per layer (B rows, one token each; ``rms(x, w) = x * rsqrt(mean(x^2) + eps) * w``, plain weight):

* attention residuals (Block AttnRes): the layer library's
  (`mkc.layers.block_residuals.reference`; the reference repo's ``_residual_mixture_row`` /
  ``stack``): each sublayer and the final norm read a learned softmax mixture of the embedding,
  the completed blocks of ``attn_res_block_size`` layers and the block being filled;
* attention input ``rms(mix, input_layernorm)``; KDA (``linear_attention``) or MLA
  (``full_attention``, K3: ``i % 4 == 3`` or the last layer);
* KDA: the layer library's (`mkc.layers.kda.reference`: a short conv, the delta rule with a
  decay per key channel, ``gate_lower_bound = -5``, the gated output norm, ``o_proj``);
* MLA (NoPE): ``q = q_b_proj(rms(q_a_proj(x), q_a_layernorm))`` per head ``[nope | extra]``;
  ``[c | k_extra] = kv_a_proj_with_mqa(x)``, ``c = rms(c, kv_a_layernorm)``; ``kv_b_proj(c)`` per
  head ``[k_nope | v]``; key = ``[k_nope | k_extra]`` (k_extra shared by all heads); scores scaled
  by ``(qk_nope + qk_rope)**-0.5``; output ``* sigmoid(g_proj(x))``, then ``o_proj``;
* MLP input ``rms(mix, post_attention_layernorm)``; layers ``< first_k_dense_replace`` use a
  dense ``mlp``, the rest ``block_sparse_moe``; every GLU uses SiTU
  ``4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)``;
* latent MoE: sigmoid router scores ``s``; ``top_k(s + e_score_correction_bias)`` picks the
  experts (bias for selection only); weights ``s[ids] / sum s[ids] * routed_scaling_factor``;
  the routed experts run in the latent space: ``z = routed_expert_down_proj(x)``,
  ``y = sum_k w_k * w2_k(situ(w1_k z, w3_k z))``, ``routed_expert_up_proj(rms(y,
  routed_expert_norm))``; plus the shared experts (``num_shared_experts * moe_intermediate_size``
  wide) on x. Experts ``w1`` (gate), ``w3`` (up), ``w2`` (down) are MXFP4: ``weight_packed``
  uint8 ``[out, in/2]`` and ``weight_scale`` uint8 (E8M0) ``[out, in/32]``.

State layouts (``init_cache``; B = batch, T = context, P = KDA heads * head_dim):

* ``layers.{i}.conv_state``      bf16 ``[B, 3P, K-1]`` (KDA): channels ``[q | k | v]``, time
  oldest first (`mkc.layers.kda.reference`).
* ``layers.{i}.recurrent_state`` f32  ``[B, heads, D, D]`` (KDA): per head S with ``o = S^T q``
  (key axis first), the reference repo's ``[heads, K, V]``.
* ``layers.{i}.latent_cache``    bf16 ``[B, T, kv_lora_rank + qk_rope_head_dim]`` (MLA): slot t
  holds position t as ``[rms(c, kv_a_layernorm) | k_extra]``, the 576-wide MLA latent.

bf16 storage applies where a value enters a cache (conv inputs, latent rows) and the new token's
own entry is read back from the cache, so a token sees the same values whether current or past.
Row b attends to slots ``0..positions[b]``; positions must be < T. The KDA states advance by one
token per call whatever the position: feed each row its tokens in order.

Kernel rounding emulation: the computing functions take an optional ``rounding``
(``mkc.reference.rounding.Rounding``, from a compiled schedule by
``mkc.numerics.rounding_from_ir``). With it the step rounds where the generated kernel does:
every matmul's activation input to bf16 (so ``f_b_proj`` sees a bf16 ``f_a_proj`` output and
``q_b_proj`` a bf16 ``q_a`` latent); the KDA and MLA ``o_proj``, the dense ``down``, the shared
experts' ``down`` and the routed experts as per-rank partial sums (heads and widths split as
the schedule's ``per_rank`` sizes say; a routed expert's width split over its group's
``expert_tp`` ranks, each rank summing its group's experts in id order) all-reduced stage by
stage on the spec's wire dtype; the all-gathered latent and ``latent_up`` output and the
exchanged router logits in their buffers' dtypes; the embedding's exact all-reduce; states and
the latent cache in their storage dtypes. It also sums in the kernel's f32 order, or one-ulp
bf16 flips spread through the step (see "The kernel's f32 order" below and ``mkc.numerics``):
streamed matrices ring tile by ring tile and expert matrices MXFP4 pack group by pack group,
MLA weight-absorbed with an online softmax over the schedule's KV tiles, and the kernel's
formulation in the kernel's shapes wherever XLA's order depends on them. Sublayer kinds are
the schedule's names: ``kda``, ``mla``, ``dense``, ``moe``.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.families.kimi_k3.config import BLOCK_SCALE, KimiDims, read_dims
from mkc.families.kimi_k3.graph import ATTENTION
from mkc.layers.block_residuals import reference as block_reference
from mkc.layers.expert_formats import pack_groups
from mkc.layers.expert_formats.reference import expert_operands
from mkc.layers.kda import reference as kda_reference
from mkc.layers.mla import reference as mla_reference
from mkc.layers.moe import reference as moe_reference
from mkc.layers.ops import situ   # SiTU GLU: beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta)
from mkc.layers.reference import linear, matmul, mm_input, out_projection, rms_norm  # KimiRMSNorm: plain
from mkc.model.config import read_checked_dims, upstream_config
from mkc.model.mxfp4 import BLOCK_SIZE, mxfp4_dequantize_jax, mxfp4_quantize
from mkc.reference.rounding import Rounding, allreduce, bf16_weights, round_to

KDA = "linear_attention"
MLA = "full_attention"
MODEL_TYPES = ("kimi_k3", "kimi_linear")  # checkpoint top level / its text_config

_HIGHEST = jax.lax.Precision.HIGHEST
KDA_ATTENTION = ATTENTION["kda"]   # the layer library's KDA
MLA_ATTENTION = ATTENTION["mla"]   # the layer library's MLA, gated and NoPE
ATTENTION = {KDA: KDA_ATTENTION, MLA: MLA_ATTENTION}   # by upstream attention type
_EXPERT_MATRICES = ("w1", "w3", "w2")  # gate, up, down (Kimi Linear naming)
# Projections whose output is summed into a residual block (scaled down by init_params).
_WRITES_RESIDUAL = ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                    "shared_experts.down_proj.weight", "routed_expert_up_proj.weight")


def load_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> KimiDims:
    """The config of a Kimi K3 model (dict, config.json path, or checkpoint directory; a
    composite config's ``text_config``): the family's dims, read by its one config reader
    (``config.read_dims``; the reference reads them by their upstream names, ``KimiDims``'
    properties): settings mkc does not compute are refused there (ConfigError, a ValueError
    with its hint; see ``config.REQUIRED``). Hashable, so it is the static jit argument of
    ``decode_step``."""
    raw, name = upstream_config(path_or_dict)
    if raw.get("model_type", "kimi_linear") not in MODEL_TYPES:
        raise ValueError(f"expected model_type in {MODEL_TYPES}, got {raw.get('model_type')!r}")
    return read_checked_dims(read_dims, raw, name)


def param_shapes(cfg: KimiDims) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every parameter name -> (PyTorch shape, dtype name); linear weights are ``[out, in]``.

    Routed experts appear as MXFP4 pairs: ``...experts.{e}.w{1,2,3}.weight_packed`` (uint8,
    ``[out, in/2]``) and ``.weight_scale`` (uint8 E8M0, ``[out, in/32]``). The KDA scalars
    (``A_log``, ``dt_bias``, conv filters, ``o_norm``) and the router correction bias are f32.
    """
    h = cfg.hidden_size
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, h), _BF16),
    }
    for i, kind in enumerate(cfg.attention_types):
        p = f"model.layers.{i}."
        shapes |= block_reference.mix_shapes(cfg, p + "self_attention_res")
        shapes |= block_reference.mix_shapes(cfg, p + "mlp_res")
        shapes[p + "input_layernorm.weight"] = ((h,), _BF16)
        shapes[p + "post_attention_layernorm.weight"] = ((h,), _BF16)
        attention = ATTENTION[kind]   # the library kind's own parameters
        shapes |= attention.module("reference").block_shapes(attention, cfg, p)
        if cfg.is_moe(i):
            shapes |= _moe_shapes(cfg, p + "block_sparse_moe.")
        else:
            inter, m = cfg.intermediate_size, p + "mlp."
            shapes |= {m + "gate_proj.weight": ((inter, h), _BF16),
                       m + "up_proj.weight": ((inter, h), _BF16),
                       m + "down_proj.weight": ((h, inter), _BF16)}
    shapes |= block_reference.mix_shapes(cfg, "model.output_attn_res")
    shapes["model.norm.weight"] = ((h,), _BF16)
    shapes["lm_head.weight"] = ((cfg.vocab_size, h), _BF16)     # untied (config REQUIRED)
    return shapes


_BF16, _F32, _U8 = "bfloat16", "float32", "uint8"
_Shapes = dict[str, tuple[tuple[int, ...], str]]


def _moe_shapes(cfg: KimiDims, m: str) -> _Shapes:
    h, lat, inter = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    shared = cfg.shared_expert_intermediate_size
    shapes: _Shapes = {
        m + "gate.weight": ((cfg.experts, h), _BF16),
        m + "gate.e_score_correction_bias": ((cfg.experts,), _F32),
        m + "routed_expert_down_proj.weight": ((lat, h), _BF16),
        m + "routed_expert_norm.weight": ((lat,), _BF16),
        m + "routed_expert_up_proj.weight": ((h, lat), _BF16),
        m + "shared_experts.gate_proj.weight": ((shared, h), _BF16),
        m + "shared_experts.up_proj.weight": ((shared, h), _BF16),
        m + "shared_experts.down_proj.weight": ((h, shared), _BF16),
    }
    for e in range(cfg.experts):
        for w, (out, inp) in zip(_EXPERT_MATRICES, ((inter, lat), (inter, lat), (lat, inter))):
            shapes[m + f"experts.{e}.{w}.weight_packed"] = ((out, inp // 2), _U8)
            shapes[m + f"experts.{e}.{w}.weight_scale"] = ((out, inp // BLOCK_SIZE), _U8)
    return shapes


def expert_logical_shape(cfg: KimiDims, matrix: str) -> tuple[int, int]:
    """Dequantized ``[out, in]`` shape of routed-expert matrix ``w1``, ``w2`` or ``w3``."""
    lat, inter = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    return (lat, inter) if matrix == "w2" else (inter, lat)


def init_params(cfg: KimiDims, seed: int) -> dict[str, np.ndarray]:
    """Random parameters (dtypes per ``param_shapes``) scaled so activations and logits stay O(1).

    Projections are N(0, 1/fan_in); those writing into the residual sources (``o_proj``,
    ``down_proj``, ``routed_expert_up_proj``) are further scaled by 1/sqrt(2 * block size), as a
    block sums that many outputs. Norm weights are noise around 1 (the Kimi norms are not
    zero-centred); the residual projections are N(0, 1/H) so the source softmax is neither flat
    nor one-hot. The KDA gates and conv taps are the KDA kind's draws
    (`mkc.layers.kda.reference.init_weight`).
    Routed experts are drawn as Gaussians and stored through ``mxfp4_quantize``.
    """
    rng = np.random.default_rng(seed)
    out_scale = 1.0 / math.sqrt(2 * cfg.attn_res_block_size)
    out: dict[str, np.ndarray] = {}
    scales: dict[str, np.ndarray] = {}
    for name, (shape, dtype) in param_shapes(cfg).items():
        if name.endswith(".weight_scale"):
            out[name] = scales.pop(name)
            continue
        if name.endswith(".weight_packed"):
            matrix = name.split(".")[-2]
            logical = expert_logical_shape(cfg, matrix)
            w = rng.normal(0.0, 1.0 / math.sqrt(logical[1]), logical)
            out[name], scales[name.replace("weight_packed", "weight_scale")] = mxfp4_quantize(w)
            continue
        kda = kda_reference.init_weight(KDA_ATTENTION, name, shape, rng)
        if kda is not None:
            w = kda
        elif name == "model.embed_tokens.weight":
            w = rng.normal(0.0, 1.0, shape)
        elif name.endswith("_res_proj.weight"):
            w = rng.normal(0.0, 1.0 / math.sqrt(cfg.hidden_size), shape)
        elif name.endswith(("norm.weight", "layernorm.weight")):
            w = 1.0 + rng.normal(0.0, 0.1, shape)
        elif name.endswith("e_score_correction_bias"):
            w = rng.normal(0.0, 0.05, shape)
        else:
            std = 1.0 / math.sqrt(shape[-1])
            if name.endswith(_WRITES_RESIDUAL):
                std *= out_scale
            w = rng.normal(0.0, std, shape)
        out[name] = bf16_weights(w) if dtype == "bfloat16" else w.astype(np.dtype(dtype))
    return out


def init_cache(cfg: KimiDims, batch: int, context: int) -> dict[str, jax.Array]:
    """Zeroed decode state; see the module docstring for the layouts."""
    cache: dict[str, jax.Array] = {}
    for i, kind in enumerate(cfg.attention_types):
        attention = ATTENTION[kind]
        cache |= attention.module("reference").init_cache(attention, cfg, i, batch, context)
    return cache


# ---------------------------------------------------------------------------------------------
# Building blocks (public so tests can check them in isolation).


def glu_mlp(p: Mapping[str, jax.Array], cfg: KimiDims, x: jax.Array,
            rounding: Rounding | None = None, kind: str = "dense", op: str = "down",
            shard: str = "inter", gate_up: str = "gate_up") -> jax.Array:
    """``down(situ(gate(x), up(x)))`` with ``gate_proj/up_proj/down_proj.weight`` keys in ``p``.
    With ``rounding``: ``down`` is the all-reduced op ``kind.op`` over per-rank ranges of the
    ``shard`` size (``inter`` for the dense MLP, ``shared`` for the shared experts), and
    ``kind.gate_up`` names the streamed gate|up matrix."""
    x = mm_input(x, rounding)
    hidden = situ(matmul(x, p["gate_proj.weight"], rounding, kind, gate_up, by_tiles=True),
                  matmul(x, p["up_proj.weight"], rounding, kind, gate_up, by_tiles=True),
                  cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    per_rank = None if rounding is None else rounding.size(shard)
    return out_projection(hidden, p["down_proj.weight"], rounding, kind, op, per_rank, "mlp", by_tiles=True)


# ---------------------------------------------------------------------------------------------
# The kernel's f32 order (the rounding emulation only)
#
# Rounding where the kernel rounds is not enough: where the emulation sums in another f32 order
# than the kernel, a bf16 rounding downstream can land one ulp apart, and such flips spread
# through the rest of the step and through the recurrent state (measured on K3 MINI before
# these helpers: as far from the kernel as a 1 % op error, for some tokens already at step 0).
# The order of an f32 sum on XLA, which runs the kernel in the tests (TPU interpret mode on
# CPU), depends on how the sum is written and on its shapes: a fused ``a * b + c`` may become
# one FMA, and a reduction over many rows is vectorised otherwise than one over a few. So each
# helper writes the kernel's formulation in the kernel's shapes and is jitted whole, as the
# kernel's body is compiled whole. Each was checked bit-equal to the values of an instrumented
# K3 MINI kernel from the same inputs (issue 12), where the plain forms above were not: the l2
# norms of all heads at once, the conv and the delta rule unfused, the residual mixture as a
# softmax and a dot, the attention unabsorbed, the experts' weighted sum unfused.


def route(logits: jax.Array, bias: jax.Array, top_k: int,
          scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Sigmoid routing ``[..., E] -> (ids [..., k], weights [..., k])``: the correction bias only
    picks the experts; the weights are the uncorrected scores renormalised over the chosen k,
    times ``scaling``: the layer library's MoE router with one group (`mkc.layers.moe.reference.route`)."""
    return moe_reference.route(logits, top_k, True, "sigmoid", bias, scaling)


def selection_scores(logits: jax.Array, bias: jax.Array, top_k: int, scaling: float = 1.0
                     ) -> tuple[jax.Array, int]:
    """What ``route`` (same arguments) takes the top k of, and that k: the sigmoid scores plus
    the correction bias. The harness's near-tie rule reads it (``examples/generated_module``)."""
    return moe_reference.selection_scores(logits, top_k, True, "sigmoid", bias, scaling)


def _kernel_route_weights(logits: jax.Array, ids: jax.Array, scaling: float) -> jax.Array:
    """Routing weights over every expert ``[B, E]`` as the kernel forms them: the chosen scores
    (zero elsewhere) divided by their sum over all E lanes, times ``scaling`` (the layer
    library's, eager: `mkc.layers.moe.reference.dense_route_weights`)."""
    return moe_reference.dense_route_weights(logits, ids, True, "sigmoid", scaling)


def _routed_experts_per_rank(p: Mapping[str, jax.Array], cfg: KimiDims, latent: jax.Array,
                             dense: jax.Array, rounding: Rounding) -> jax.Array:
    """The routed experts as the kernel computes them, in the latent space: the layer library's
    expert-parallel sum (`mkc.layers.moe.reference.expert_parallel_sum`: each rank's part of its
    group's experts, weighted and added in id order, all-reduced) of each expert's SiTU GLU,
    each matrix pack group by pack group."""
    width = rounding.size("expert_width")
    groups = pack_groups({"gate_up": cfg.routed_expert_hidden_size, "down": width})
    lat = rounding.mm_in(latent)
    operands = {m: expert_operands(rounding, m) for m in ("gate_up", "down")}

    def decoded(e: int, matrix: str) -> jax.Array:
        return mxfp4_dequantize_jax(p[f"experts.{e}.{matrix}.weight_packed"],
                                    p[f"experts.{e}.{matrix}.weight_scale"],
                                    expert_logical_shape(cfg, matrix))

    w = {e: [decoded(e, m) for m in _EXPERT_MATRICES] for e in range(cfg.experts)}
    # `scale bf16`: the codes' values above, each pack group's partial product times its
    # block's scale ([out, in/block] -> [in/group, out])
    scales = {e: [p.get(f"experts.{e}.{m}.{BLOCK_SCALE}") for m in _EXPERT_MATRICES]
              for e in range(cfg.experts)}

    def per_group(s: jax.Array | None, w: jax.Array, group: int, rows: slice = slice(None),
                  cols: slice = slice(None)) -> jax.Array | None:
        """Matrix w's block scales (None: MXFP4's, already in its values) for its output
        `rows` and input `cols`, one row per pack group of `group` inputs: [in/group, out]."""
        if s is None:
            return None
        block = w.shape[1] // s.shape[1]
        cols = slice((cols.start or 0) // block, (cols.stop or w.shape[1]) // block)
        return jnp.repeat(jnp.asarray(s, jnp.float32)[rows, cols], block // group, axis=1).T

    def expert(e: int, cols: slice) -> jax.Array:
        w1, w3, w2 = w[e]
        s1, s3, s2 = scales[e]
        gu = groups["gate_up"]
        hidden = situ(rounding.linear(lat, w1[cols], gu, operands["gate_up"], per_group(s1, w1, gu, cols)),
                      rounding.linear(lat, w3[cols], gu, operands["gate_up"], per_group(s3, w3, gu, cols)),
                      cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
        return rounding.linear(hidden, w2[:, cols], groups["down"], operands["down"],
                               per_group(s2, w2, groups["down"], cols=cols))

    return moe_reference.expert_parallel_sum(rounding, cfg.experts, dense, cfg.routed_expert_hidden_size,
                                             expert, "moe")


def moe_block(p: Mapping[str, jax.Array], cfg: KimiDims, x: jax.Array,
              rounding: Rounding | None = None) -> jax.Array:
    """Latent MoE for normed input ``x [B, H]``; ``p`` maps names relative to
    ``block_sparse_moe.`` (f32 dense weights; uint8 expert codes/scales)."""
    xin = mm_input(x, rounding)
    router = matmul(xin, p["gate.weight"], rounding, "moe", "router", by_tiles=True)
    if rounding is not None:
        router = round_to(router, rounding.exchange_wire("moe", "router"))
    ids, weights = route(router, p["gate.e_score_correction_bias"],
                         cfg.top_k, cfg.routed_scaling_factor)
    latent = matmul(xin, p["routed_expert_down_proj.weight"], rounding, "moe", "latent_down", by_tiles=True)
    shared = {n[len("shared_experts."):]: w for n, w in p.items() if n.startswith("shared_experts.")}
    if rounding is not None:
        latent = round_to(latent, rounding.gather_wire("moe", "latent_down"))
        dense = _kernel_route_weights(router, ids, cfg.routed_scaling_factor)
        routed = _routed_experts_per_rank(p, cfg, latent, dense, rounding)
        routed = rms_norm(routed, p["routed_expert_norm.weight"], cfg.rms_norm_eps)
        up = round_to(matmul(routed, p["routed_expert_up_proj.weight"], rounding, "moe", "latent_up",
                             by_tiles=True),
                      rounding.gather_wire("moe", "latent_up"))
        return up + glu_mlp(shared, cfg, x, rounding, "moe", "shared_down", "shared", "shared_gate_up")

    def expert_weights(matrix: str) -> jax.Array:
        """The chosen experts' matrix, gathered while packed, decoded to f32 ``[B, k, out, in]``
        (`scale bf16`: times its block scales)."""
        def stacked(kind: str) -> jax.Array:
            return jnp.stack([jnp.asarray(p[f"experts.{e}.{matrix}.{kind}"]) for e in range(cfg.experts)])
        shape = (*ids.shape, *expert_logical_shape(cfg, matrix))
        values = mxfp4_dequantize_jax(stacked("weight_packed")[ids], stacked("weight_scale")[ids], shape)
        if f"experts.0.{matrix}.{BLOCK_SCALE}" not in p:
            return values
        block_scales = stacked(BLOCK_SCALE)[ids].astype(jnp.float32)
        return values * jnp.repeat(block_scales, shape[-1] // block_scales.shape[-1], axis=-1)

    gate = jnp.einsum("bl,bkol->bko", latent, expert_weights("w1"), precision=_HIGHEST)
    up = jnp.einsum("bl,bkol->bko", latent, expert_weights("w3"), precision=_HIGHEST)
    hidden = situ(gate, up, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    down = jnp.einsum("bki,bkoi->bko", hidden, expert_weights("w2"), precision=_HIGHEST)
    routed = jnp.einsum("bk,bko->bo", weights, down, precision=_HIGHEST)
    routed = rms_norm(routed, p["routed_expert_norm.weight"], cfg.rms_norm_eps)
    return linear(routed, p["routed_expert_up_proj.weight"]) + glu_mlp(shared, cfg, x)


# ---------------------------------------------------------------------------------------------
# Whole model


def _sub_params(params: Mapping[str, Any], prefix: str) -> dict[str, jax.Array]:
    """Parameters under ``prefix``, renamed relative to it; floats upcast to f32, codes kept."""
    out = {}
    for name, w in params.items():
        if name.startswith(prefix):
            w = jnp.asarray(w)
            out[name[len(prefix):]] = w if w.dtype == jnp.uint8 else w.astype(jnp.float32)
    return out


def embed(params: Mapping[str, Any], tokens: jax.Array, rounding: Rounding | None = None
          ) -> jax.Array:
    """Token embeddings ``[B, H]`` f32. With ``rounding``: as the vocab-sharded kernel forms
    them, each rank contributing the rows it owns (zeros elsewhere) to the embedding all-reduce
    (exact for bf16 rows on a bf16 or f32 wire, emulated all the same)."""
    x = jnp.asarray(params["model.embed_tokens.weight"])[tokens].astype(jnp.float32)
    if rounding is None:
        return x
    owner = tokens // rounding.size("vocab")
    partials = [jnp.where((owner == r)[:, None], x, 0.0) for r in range(rounding.ranks)]
    return allreduce(partials, rounding.reduce("embed", "embed"))


def decode_hidden(params: Mapping[str, Any], cfg: KimiDims, cache: Mapping[str, jax.Array],
                  tokens: jax.Array, positions: jax.Array, rounding: Rounding | None = None
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """All decoder layers for one token per row: (final residual mixture ``[B, H]`` before the
    final norm, new cache). ``decode_step`` adds the final norm and the LM head."""
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    embedding = embed(params, tokens, rounding)
    new_cache = dict(cache)
    eps = cfg.rms_norm_eps

    def mix(j: int, sources: jax.Array) -> jax.Array:
        return block_reference.mix(params, cfg, j, sources, rounding)

    def sublayer(j: int, h: jax.Array) -> jax.Array:
        i = j // 2
        lp = _sub_params(params, f"model.layers.{i}.")
        if j % 2 == 0:
            x = rms_norm(h, lp["input_layernorm.weight"], eps)
            attn = {n[len("self_attn."):]: w for n, w in lp.items() if n.startswith("self_attn.")}
            if cfg.attention_types[i] == KDA:
                out, new_cache[f"layers.{i}.conv_state"], new_cache[f"layers.{i}.recurrent_state"] = (
                    kda_reference.block(KDA_ATTENTION, attn, cfg, x, cache[f"layers.{i}.conv_state"],
                                        cache[f"layers.{i}.recurrent_state"], rounding, "kda"))
            else:
                out, new_cache[f"layers.{i}.latent_cache"] = mla_reference.block(
                    MLA_ATTENTION, attn, cfg, x, cache[f"layers.{i}.latent_cache"], positions, rounding)
            return out
        x = rms_norm(h, lp["post_attention_layernorm.weight"], eps)
        if cfg.is_moe(i):
            moe = {n[len("block_sparse_moe."):]: w for n, w in lp.items()
                   if n.startswith("block_sparse_moe.")}
            return moe_block(moe, cfg, x, rounding)
        return glu_mlp({n[len("mlp."):]: w for n, w in lp.items() if n.startswith("mlp.")}, cfg, x,
                       rounding)

    hidden = block_reference.block_attention_residuals(embedding, cfg.num_hidden_layers,
                                                       cfg.attn_res_block_size, sublayer, mix)
    return hidden, new_cache


def decode_step(params: Mapping[str, Any], cfg: KimiDims, cache: Mapping[str, jax.Array],
                tokens: jax.Array, positions: jax.Array, rounding: Rounding | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One decode token per row: (logits f32 ``[B, vocab]``, new cache).

    jit with ``jax.jit(decode_step, static_argnums=(1, 5))``; ``params`` may be numpy arrays.
    ``rounding`` switches on the kernel rounding emulation (module docstring).
    """
    x, new_cache = decode_hidden(params, cfg, cache, tokens, positions, rounding)
    x = rms_norm(x, jnp.asarray(params["model.norm.weight"]).astype(jnp.float32), cfg.rms_norm_eps)
    head = params["lm_head.weight"]
    return matmul(x, jnp.asarray(head).astype(jnp.float32), rounding, "tail", "lm_head",
                  by_tiles=True), new_cache


def count_parameters(cfg: KimiDims) -> int:
    """Logical parameter count: two weights per packed MXFP4 byte, E8M0 scales not counted."""
    total = 0
    for name, (shape, _) in param_shapes(cfg).items():
        if name.endswith(".weight_scale"):
            continue
        total += math.prod(shape) * (2 if name.endswith(".weight_packed") else 1)
    return total


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
``x [B, H]``: the layer library's ``MoE(norm="zero_centred", shared_expert=True)``, whose
reference (``mkc.layers.moe.reference``) states its math and its rounding emulation. Its
router (``Qwen3_5MoeTopKRouter``) ALWAYS divides the top-k probabilities by their sum (the
config reader refuses ``norm_topk_prob`` false; the flag exists so tests can show what it
changes).

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
(``mkc.layers.moe.EXPERT_LAYOUTS``).

Kernel rounding emulation (``rounding``, as in the Qwen3.5 reference): the mixers round as
Qwen3.5's do (layer kinds ``gdn`` and ``gqa``), the MoE block as the library's (kind ``moe``).
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

from mkc.families.qwen3_5 import reference as qwen
from mkc.families.qwen3_5.reference import FULL, LINEAR, Qwen35Config, embed, init_cache, linear, rms_norm
from mkc.families.qwen3_5_moe.config import MODEL_TYPES, read_dims
from mkc.families.qwen3_5_moe.graph import LAYERS
from mkc.layers.moe import reference as moe
from mkc.layers.moe.reference import route, selection_scores
from mkc.model.config import in_range, upstream_config
from mkc.reference.rounding import Rounding, bf16_weights

# The layer-loop kind of the MoE sublayer: the schedule's all-reduces of its ops live there.
MOE_KIND = "moe"

__all__ = ["FULL", "LINEAR", "Qwen35MoeConfig", "count_parameters", "decode_hidden",
           "decode_step", "embed", "init_cache", "init_params", "linear", "load_config", "moe_block",
           "param_shapes", "route", "selection_scores"]
MOE = LAYERS[MOE_KIND][0]


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

    # the names the layer library's MoE reads
    @property
    def experts(self) -> int:
        return self.num_experts

    @property
    def top_k(self) -> int:
        return self.num_experts_per_tok


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


def param_shapes(cfg: Qwen35MoeConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every HF parameter name of ``Qwen3_5MoeForCausalLM`` -> (PyTorch shape, dtype name).

    The Qwen3.5 table with each layer's dense MLP replaced by the MoE block's parameters."""
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, spec in qwen.param_shapes(cfg).items():
        layer, sep, rest = name.partition(".mlp.")
        if not sep:
            shapes[name] = spec
        elif rest == "gate_proj.weight":   # the first of the dense MLP's three: the MoE goes here
            shapes |= moe.block_shapes(MOE, cfg, layer + ".")
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


def moe_block(p: Mapping[str, jax.Array], cfg: Qwen35MoeConfig, x: jax.Array,
              rounding: Rounding | None = None, kind: str = "") -> jax.Array:
    """Qwen3_5MoeSparseMoeBlock for the normed ``x [B, H]``; ``p`` maps names relative to
    ``mlp.`` (e.g. ``"experts.gate_up_proj"``) to f32 arrays (``mkc.layers.moe.reference.block``)."""
    return moe.block(MOE, p, cfg, x, rounding, kind)


# ---------------------------------------------------------------------------------------------
# Whole model


def decode_hidden(params: Mapping[str, Any], cfg: Qwen35MoeConfig, cache: Mapping[str, jax.Array],
                  tokens: jax.Array, positions: jax.Array, rounding: Rounding | None = None
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Qwen3.5's decoder layers with the MoE block as each layer's MLP."""
    return qwen.decode_hidden(
        params, cfg, cache, tokens, positions, rounding,
        mlp_residual=lambda p, cfg, resid, x, rounding, kind: moe.residual(MOE, p, cfg, resid, x, rounding,
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

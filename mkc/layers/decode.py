"""The reference decode step of a family composed from the library (`DecoderReference`): the
embedding, each layer's sublayers in order (each owns its pre-norm, its block and its residual
add: `mkc.layers.<kind>.reference.forward`; under another residual strategy, such as block
attention residuals, the strategy's sublayers form a kind's input and take its output), the
final norm and the lm_head, for one token per row at its own position. The f32 oracle by
default; with a `Rounding`, the kernel's rounding emulation (`mkc.reference.rounding`). Also
the upstream weight table, random weights for MINI runs, and zeroed caches in the reference's
(upstream) layouts."""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.layers.reference import NORM, embed, matmul, softcap_logits, sub_params
from mkc.layers.sublayer import Composition
from mkc.model.family import Family
from mkc.model import fp8_blocks
from mkc.model.config import read_checked_dims, upstream_config
from mkc.reference.rounding import Rounding, bf16_weights

RESIDUAL_WRITERS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


def _as_stored(w: Any, dtype: str) -> np.ndarray:
    """A random draw as the checkpoint stores it (dtype name)."""
    return bf16_weights(w) if dtype == "bfloat16" else np.asarray(w, dtype)


class PlainResiduals:
    """The residual stream is one ``[B, H]`` array each sublayer adds its output to."""

    def start(self, embedding: jax.Array, d: Any = None) -> Any:
        """The stream from the token embeddings (`d`: the model's dims)."""
        return embedding

    def finish(self, params: Mapping[str, Any], d: Any, stream: Any, rounding: Rounding | None) -> jax.Array:
        """The final norm's input."""
        return stream

    def global_shapes(self, d: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        """Its parameters outside the layers (before the final norm's)."""
        return {}

    def residual_scale(self, d: Any) -> float:
        """The factor on random weights that write the stream: as many outputs add up as there
        are sublayers."""
        return 1.0 / math.sqrt(2 * d.num_hidden_layers)


def norms_last(name: str) -> int:
    """A `draw_rank` drawing each layer's layer norms after its other tensors."""
    return int(name.endswith("layernorm.weight"))


class DecoderReference:
    """The `contracts.Reference` functions of a composition; the config is the family's dims."""

    def __init__(self, layers: Composition, read_dims: Callable[[Mapping, str], Any],
                 model_types: tuple[str, ...], final_norm: str = "plain",
                 model_layer: Callable[[int], int] = lambda layer: layer,
                 draw_rank: Callable[[str], int] | None = None, residuals: Any = PlainResiduals(),
                 softcap: bool = False):
        # `model_layer`: the model layer of a loop layer (a family whose sublayers are loop
        # layers of their own, attention then MoE, runs two a model layer). `draw_rank`: random
        # weights draw a layer's tensors in the order of this rank of their names under the
        # layer (stable; e.g. `norms_last`, Qwen3.5's order, which its recorded MINI results
        # were drawn in). `residuals`: the residual strategy (`PlainResiduals`, or e.g.
        # `mkc.layers.block_residuals.reference.BLOCK_RESIDUALS`). `softcap`: the logits soft
        # capped, padded vocabulary ids -inf (`mkc.layers.reference.softcap_logits`; the
        # kernel's `mkc.layers.decoder.lowering.softcapped_logits`).
        self.layers, self.read_dims, self.model_types = layers, read_dims, model_types
        self.final_norm, self.model_layer, self.draw_rank = final_norm, model_layer, draw_rank
        self.residuals, self.softcap = residuals, softcap

    @classmethod
    def of(cls, family: Family, **options: Any) -> DecoderReference:
        """The reference of `family`'s composition (`Family.layers`), read by its config reader."""
        return cls(family.layers, family.read_dims, family.model_types, **options)

    def functions(self) -> tuple[Callable, ...]:
        """load_config, param_shapes, init_params, init_cache, decode_step: the names a family's
        reference module binds (`mkc.model.contracts.Reference`)."""
        return self.load_config, self.param_shapes, self.init_params, self.init_cache, self.decode_step

    def load_config(self, path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> Any:
        """The model's dims (dict, config.json path or checkpoint directory), read by the
        family's one config reader."""
        raw, name = upstream_config(path_or_dict)
        if raw.get("model_type", self.model_types[0]) not in self.model_types:
            raise ValueError(f"expected model_type {self.model_types[0]!r}, got {raw.get('model_type')!r}")
        return read_checked_dims(self.read_dims, raw, name)

    def _owned_shapes(self, d: Any) -> dict[str, tuple[tuple[int, ...], str, Any]]:
        """Every upstream parameter -> (shape, dtype, the sublayer owning it or None)."""
        bf16 = "bfloat16"
        out: dict[str, tuple[tuple[int, ...], str, Any]] = {
            "model.embed_tokens.weight": ((d.vocab_size, d.hidden_size), bf16, None)}
        for i, kind in enumerate(d.layer_kinds):
            for sub in self.layers[kind]:
                shapes = sub.module("reference").param_shapes(sub, d, f"model.layers.{self.model_layer(i)}.")
                out |= {name: (*spec, sub) for name, spec in shapes.items()}
        out |= {name: (*spec, None) for name, spec in self.residuals.global_shapes(d).items()}
        out["model.norm.weight"] = ((d.hidden_size,), bf16, None)
        out["lm_head.weight"] = ((d.vocab_size, d.hidden_size), bf16, None)
        return out

    def param_shapes(self, d: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every upstream parameter name -> (PyTorch shape, dtype name); with an FP8
        checkpoint (the dims' `weight_block_size`) its linear weights as e4m3 codes beside
        their f32 block scales (`mkc.model.fp8_blocks.quantized_weights`)."""
        shapes = {name: (shape, dtype) for name, (shape, dtype, _) in self._owned_shapes(d).items()}
        block = getattr(d, "weight_block_size", ())
        return fp8_blocks.quantized_weights(shapes, block) if block else shapes

    def init_params(self, d: Any, seed: int) -> dict[str, np.ndarray]:
        """Random weights (bf16, or the table's dtype) scaled so the residual stream and logits
        stay O(1) at any depth: projections N(0, 1/fan_in), those writing the residual stream
        further by 1/sqrt(2 layers), the lm_head of soft-capped logits by 1/output_multiplier;
        norm weights near their gain of 1 (1 + w for a zero-centred norm); a kind's own tensors
        as its reference's `init_weight` draws them (several at once where it returns them by
        name, uint8 codes with their scales)."""
        rng = np.random.default_rng(seed)
        residual_scale = self.residuals.residual_scale(d)
        owned = self._owned_shapes(d)
        out = {}
        for name in self._draw_order(owned):
            if name in out:             # drawn with another tensor (MXFP4 scales with their codes)
                continue
            shape, dtype, sub = owned[name]
            drawn = None
            if sub is not None and hasattr(sub.module("reference"), "init_weight"):
                drawn = sub.module("reference").init_weight(sub, name, shape, rng, residual_scale)
            if isinstance(drawn, dict):
                out |= {n: _as_stored(w, owned[n][1]) for n, w in drawn.items()}
                continue
            if drawn is not None:
                w = drawn
            elif name == "model.embed_tokens.weight":
                w = rng.normal(0.0, 1.0, shape)
            elif name.endswith("norm.weight"):
                w = rng.normal(0.0, 0.1, shape) + (1.0 if self.final_norm == "plain" else 0.0)
            else:
                std = 1.0 / math.sqrt(shape[-1])
                if name == "lm_head.weight" and self.softcap:    # O(1) logits past the multiplier
                    std /= d.output_multiplier
                w = rng.normal(0.0, std * (residual_scale if name.endswith(RESIDUAL_WRITERS) else 1.0), shape)
            out[name] = _as_stored(w, dtype)
        block = getattr(d, "weight_block_size", ())
        if not block:
            return {name: out[name] for name in owned}
        # An FP8 checkpoint: the same draws, each linear weight stored as DeepSeek's recipe
        # quantizes it (its values are the codes times their scales, not the draws)
        stored: dict[str, np.ndarray] = {}
        for name in owned:
            if fp8_blocks.is_quantized(name):
                stored[name], stored[fp8_blocks.scale_name(name)] = fp8_blocks.quantize(out[name], block)
            else:
                stored[name] = out[name]
        return stored

    def _draw_order(self, names: Mapping[str, Any]) -> list[str]:
        if self.draw_rank is None:
            return list(names)
        order: list[str] = []
        layer: list[str] = []
        prefix = None
        for name in [*names, ""]:
            here = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else None
            if here != prefix or here is None:
                order += sorted(layer, key=lambda n: self.draw_rank(n.split(".", 3)[3]))
                layer, prefix = [], here
            (layer if here is not None else order).append(name)
        return order[:-1]

    def init_cache(self, d: Any, batch: int, context: int, dtype: Any = jnp.bfloat16) -> dict[str, jax.Array]:
        """Zeroed caches; KV caches in `dtype`: bf16 as the kernel and a bf16 upstream model
        store them, or f32 to compare with upstream's f32 model."""
        cache: dict[str, jax.Array] = {}
        for i, kind in enumerate(d.layer_kinds):
            for sub in self.layers[kind]:
                cache |= sub.module("reference").init_cache(sub, d, self.model_layer(i), batch, context,
                                                            dtype)
        return cache

    def decode_step(self, params: Mapping[str, Any], d: Any, cache: Mapping[str, jax.Array],
                    tokens: jax.Array, positions: jax.Array, rounding: Rounding | None = None
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One decode token per row: (logits f32 ``[B, vocab]``, new cache). jit with
        ``jax.jit(decode_step, static_argnums=(1, 5))``; ``params`` may be numpy bf16 arrays.
        An FP8 checkpoint's linear weights are read as the bf16 weights its kernel's tiles hold
        (`fp8_blocks.values`), its routed experts' codes and scales as they are (the MoE's
        reference reads them)."""
        if getattr(d, "weight_block_size", ()):
            params = fp8_blocks.values(params, d.weight_block_size, jnp)
        tokens = jnp.asarray(tokens, jnp.int32)
        positions = jnp.asarray(positions, jnp.int32)
        x = self.residuals.start(embed(params, tokens, rounding), d)
        new_cache = dict(cache)
        for i, kind in enumerate(d.layer_kinds):
            layer = self.model_layer(i)
            lp = sub_params(params, f"model.layers.{layer}.")
            for sub in self.layers[kind]:
                x = sub.module("reference").forward(sub, lp, d, x, new_cache, layer, positions, rounding,
                                                    kind)
        x = self.residuals.finish(params, d, x, rounding)
        x = NORM[self.final_norm](x, jnp.asarray(params["model.norm.weight"]).astype(jnp.float32),
                                  d.rms_norm_eps)
        logits = matmul(x, jnp.asarray(params["lm_head.weight"]).astype(jnp.float32), rounding,
                        "tail", "lm_head", by_tiles=True)
        if self.softcap:
            logits = softcap_logits(logits, cap=d.final_logit_softcapping, multiplier=d.output_multiplier,
                                    used=getattr(d, "vocab_used", d.vocab_size))
        return logits, new_cache

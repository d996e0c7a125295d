"""Where a composed family's per-rank weights come from in an upstream checkpoint: the
`contracts.Weights` functions of a family whose layer kinds are the library's
(`DecoderWeights(LAYERS)`), each tensor asked of the sublayer that owns it
(`mkc.layers.<kind>.weights`), the embedding, final norm and lm_head split over `vocab`."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mkc.ir import WeightFormat
from mkc.layers.sublayer import Composition, Sublayer
from mkc.model import fp8_blocks
from mkc.model.sharding import ShardTable


def tensor(hf: Mapping[str, np.ndarray], name: str, index=None) -> np.ndarray:
    """Tensor `name` (its part `index`) as f32, indexed before it is converted: a lazily loaded
    checkpoint (`mkc.checkpoint.StoredTensor`) then reads only this rank's part."""
    return np.asarray(hf[name] if index is None else hf[name][index]).astype(np.float32)


def no_reference_states(s: Sublayer, state: Mapping, d: Any, per_rank: dict, shards: ShardTable,
                        kind: str, layers: list[int]) -> dict[str, np.ndarray]:
    """`reference_states` of a kind that keeps no decode state."""
    return {}


def no_kernel_states(s: Sublayer, ref: Mapping, d: Any, per_rank: dict, shards: ShardTable, kind: str,
                     layers: list[int], shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """`kernel_states` of a kind that keeps no decode state."""
    return {}


def padded_block(m: np.ndarray, axis: int, index: int, width: int) -> np.ndarray:
    """Block `index` of `width` along `axis`, zero padded where it runs past the end (a split
    that does not fill its last ranks)."""
    start = index * width
    part = np.take(m, np.arange(start, min(start + width, m.shape[axis])), axis=axis)
    pad = [(0, 0)] * m.ndim
    pad[axis] = (0, width - part.shape[axis])
    return np.pad(part, pad)


def rows_of_part(total: int, cls: str, rank: int, shards: ShardTable) -> slice:
    """The contiguous range of a `total`-long dimension of shard class `cls` rank `rank` holds."""
    n = total // shards.ways(cls)
    part = shards.part(cls, rank)
    return slice(part * n, (part + 1) * n)


def _values(hf: Mapping, d: Any) -> Mapping:
    """The checkpoint with an FP8 checkpoint's linear weights read as the bf16 weights
    DeepSeek's `fp8_cast_bf16.py` writes (what the kernel's bf16 tiles hold), its routed
    experts' codes and scales as they are (`mkc.model.fp8_blocks.Dequantized`)."""
    block = getattr(d, "weight_block_size", ())
    return fp8_blocks.Dequantized(hf, block) if block else hf


class DecoderWeights:
    """The weights API (`mkc.model.contracts.Weights`) of a composition."""

    def __init__(self, layers: Composition, model_layer: Callable[[int], int] = lambda layer: layer):
        # the model layer of a loop layer (a family whose sublayers are loop layers of their
        # own, attention then MoE, runs two a model layer)
        self.layers, self.model_layer = layers, model_layer

    def _owner(self, kind: str, name: str, d: Any) -> Sublayer:
        for sub in self.layers[kind]:
            if name in sub.module("weights").tensor_names(sub, d):
                return sub
        raise KeyError(f"no sublayer of layer kind {kind} holds tensor {name!r}")

    def matrix(self, hf: Mapping, d: Any, per_rank: dict, layer: int, kind: str, name: str,
               rank: int, shards: ShardTable) -> np.ndarray:
        """Matrix `name` of loop layer `layer` ([in, out]; the lm_head after the last layer)."""
        if name == "lm_head":
            return tensor(hf, "lm_head.weight", rows_of_part(d.vocab_size, "vocab", rank, shards)).T
        sub = self._owner(kind, name, d)
        return sub.module("weights").matrix(sub, _values(hf, d), d,
                                            f"model.layers.{self.model_layer(layer)}.", name, rank, shards)

    def layer_vector(self, hf: Mapping, d: Any, per_rank: dict, layer: int, kind: str, name: str,
                     rank: int, shards: ShardTable) -> np.ndarray:
        """A per-layer vector, 2-D [rows, width] f32."""
        sub = self._owner(kind, name, d)
        return sub.module("weights").vector(sub, hf, d, f"model.layers.{self.model_layer(layer)}.", name,
                                            rank, shards)

    def _holding(self, role: str, kind: str) -> Sublayer:
        """The sublayer of layer kind `kind` whose weights module has function `role`."""
        for sub in self.layers[kind]:
            if hasattr(sub.module("weights"), role):
                return sub
        raise KeyError(f"no sublayer of layer kind {kind} has {role}")

    def expert(self, hf: Mapping, d: Any, per_rank: dict, layer: int, local: int, rank: int,
               shards: ShardTable, formats: Mapping[str, WeightFormat] | None = None
               ) -> dict[str, np.ndarray]:
        """Routed expert `local` of `rank` in loop layer `layer`, as its slot holds it."""
        sub = self._holding("expert", d.layer_kinds[layer])
        return sub.module("weights").expert(sub, hf, d, f"model.layers.{self.model_layer(layer)}.", local,
                                            rank, shards, formats)

    def requantization(self, hf: Mapping, d: Any, formats: Mapping[str, WeightFormat], shards: ShardTable,
                       layers: Sequence[int] | None = None) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
        """The checkpoint's tensors that the spec's formats requantize, as the kernel holds
        them, and the error per matrix class, of every sublayer that requantizes (its model
        layers, or those of `layers`)."""
        changed: dict[str, np.ndarray] = {}
        report: dict[str, dict] = {}
        subs = {sub for subs in self.layers.values() for sub in subs
                if hasattr(sub.module("weights"), "requantization")}
        for sub in subs:
            model_layers = sorted({self.model_layer(i) for i, kind in enumerate(d.layer_kinds)
                                   if sub in self.layers[kind]})
            prefixes = [f"model.layers.{i}." for i in model_layers if layers is None or i in layers]
            out, errors = sub.module("weights").requantization(sub, hf, d, formats, prefixes, shards)
            changed |= out
            report |= errors
        return changed, report

    def head_vectors(self, hf: Mapping, d: Any, rank: int, shards: ShardTable) -> np.ndarray:
        """The rows of the `head_norm` block the final compute body reads: the final norm."""
        return tensor(hf, "model.norm.weight")[None, :]

    def embedding(self, hf: Mapping, d: Any, rank: int, shards: ShardTable) -> np.ndarray:
        # indexed before it is an array: a lazily loaded checkpoint reads just this part
        return np.asarray(hf["model.embed_tokens.weight"][rows_of_part(d.vocab_size, "vocab", rank, shards)])

    def reference_states(self, state: Mapping, d: Any, per_rank: dict, shards: ShardTable,
                         kind_layers: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
        """The decode state in the reference's (upstream) layouts, each sublayer's gathered
        over the ranks by the sublayer."""
        out: dict[str, np.ndarray] = {}
        for kind, subs in self.layers.items():
            for sub in subs:
                layers = [self.model_layer(i) for i in kind_layers.get(kind, [])]
                out |= sub.module("weights").reference_states(sub, state, d, per_rank, shards, kind, layers)
        return out

    def kernel_states(self, ref: Mapping, d: Any, per_rank: dict, shards: ShardTable,
                      kind_layers: Mapping[str, list[int]], shapes: Mapping[str, tuple]
                      ) -> dict[str, np.ndarray]:
        """The inverse of `reference_states`: states in the reference's layouts as the kernel's
        per-rank arrays (leading rank axis; `shapes`: the kernel's per-rank state table), each
        sublayer's written by the sublayer."""
        out: dict[str, np.ndarray] = {}
        for kind, subs in self.layers.items():
            for sub in subs:
                layers = [self.model_layer(i) for i in kind_layers.get(kind, [])]
                out |= sub.module("weights").kernel_states(sub, ref, d, per_rank, shards, kind, layers,
                                                           shapes)
        return out

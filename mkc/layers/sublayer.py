"""A layer kind of the library, configured for a family: a `Sublayer` owns its graph ops and
tensors (here, without jax), its compute bodies (`<package>.lowering`), its reference math
(`<package>.reference`) and where its weights come from in an upstream checkpoint.

A family's layer kind (a phase of its specs: `gqa`, `gdn`, `moe`...) is a sequence of
sublayers, an attention kind then an MLP kind, or one of them alone. The family's lowering
is the table `body_table` builds from that composition, keyed by (layer kind, op) as Pallas
keys a lowering rule by primitive: no body branches on a kind string.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mkc.model.graph import LayerKind, Op, Tensor


@dataclass(frozen=True)
class Part:
    """What one sublayer adds to a layer kind: its ops in program order, its tensors and the
    per-rank sizes its bodies index by."""

    ops: tuple[Op, ...]
    tensors: dict[str, Tensor]
    per_rank: dict[str, int]


@dataclass(frozen=True)
class Sublayer:
    """Base of the library's layer kinds. A subclass is a frozen dataclass of the kind's
    options (the variants of one mechanism, not separate kinds), names the package holding
    its jax modules, and lists its op names without importing them."""

    package: ClassVar[str] = ""

    def op_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        """Its ops and per-rank tensors for model dims `d` split `ways` ways by shard class."""
        raise NotImplementedError

    def module(self, role: str):
        """Its `lowering`, `reference` or `weights` module (imports jax for the first two)."""
        return importlib.import_module(f"{self.package}.{role}")

    def bodies(self) -> dict[str, Callable]:
        """op -> its compute body with these options bound: `body(c, *values)`."""
        lowering = self.module("lowering")
        return {op: functools.partial(getattr(lowering, op), self) for op in self.op_names()}


Composition = Mapping[str, tuple[Sublayer, ...]]


def paired(layer: int) -> int:
    """The model layer of loop layer `layer` in a family that runs each model layer as two
    loop layers, its attention then its MLP."""
    return layer // 2


def layer_kinds(layers: Composition, d: Any, ways: Mapping[str, int], **extra: Any
                ) -> tuple[dict[str, LayerKind], dict[str, int]]:
    """The family's layer kinds from its composition, and the per-rank sizes of them all
    (two sublayers that name one size must agree on it). `extra`: LayerKind fields by kind
    name (`{"swa": {"window": 128}}`)."""
    kinds: dict[str, LayerKind] = {}
    per_rank: dict[str, int] = {}
    for name, subs in layers.items():
        ops: tuple[Op, ...] = ()
        tensors: dict[str, Tensor] = {}
        for sub in subs:
            part = sub.part(d, ways)
            ops += part.ops
            tensors |= part.tensors
            for key, value in part.per_rank.items():
                if per_rank.setdefault(key, value) != value:
                    raise ValueError(f"per-rank size {key}: {per_rank[key]} and {value} in layer kind {name}")
        kinds[name] = LayerKind(name, ops=ops, tensors=tensors, **extra.get(name, {}))
    return kinds, per_rank


def body_table(layers: Composition) -> dict[tuple[str, str], Callable]:
    """(layer kind, op) -> compute body: what `mkc.runtime.scopes.named_ops` dispatches on."""
    table: dict[tuple[str, str], Callable] = {}
    for name, subs in layers.items():
        for sub in subs:
            for op, body in sub.bodies().items():
                if (name, op) in table:
                    raise ValueError(f"layer kind {name}: two sublayers lower op {op}")
                table[name, op] = body
    return table

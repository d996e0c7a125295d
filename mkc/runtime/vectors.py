"""Per-layer vectors (norm weights, biases, small per-head tables), double-buffered by layer
parity: layer l's f32 block [rows, cols] sits in slot l % 2 and is issued `ahead` layers early.
A block holds each vector family at a fixed (first row, rows, width) of its layer kind."""
from __future__ import annotations

from dataclasses import dataclass

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


@dataclass(frozen=True)
class Parity:
    ahead: int
    rows: int
    cols: int
    layout: dict[str, dict[str, tuple[int, int, int]]]   # kind -> family -> (row, rows, width)


@dataclass(frozen=True)
class VectorRefs:
    hbm: object          # [layers, rows, cols] f32
    slots: object        # [2, rows, cols] f32 VMEM
    sems: object         # DMA semaphores (2,)


def copy(refs: VectorRefs, layer):
    slot = lax.rem(layer, 2)
    return pltpu.make_async_copy(refs.hbm.at[layer], refs.slots.at[slot], refs.sems.at[slot])


def fill(parity: Parity, refs: VectorRefs, layers: int) -> None:
    """The prologue: the first `ahead` layers' blocks."""
    for layer in range(min(parity.ahead, layers)):
        copy(refs, layer).start()


def arrive(parity: Parity, refs: VectorRefs, layer, layers: int) -> None:
    """At a layer's start: wait for its block and issue the block `ahead` layers on."""
    if parity.ahead == 0:
        copy(refs, layer).start()
    copy(refs, layer).wait()
    if parity.ahead > 0:
        @pl.when(layer + parity.ahead < layers)
        def _():
            copy(refs, layer + parity.ahead).start()


def vector(parity: Parity, refs: VectorRefs, kind: str, name: str, layer) -> jax.Array:
    row, rows, width = parity.layout[kind][name]
    return refs.slots[lax.rem(layer, 2), row:row + rows, :width]

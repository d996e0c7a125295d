"""What a trace event is about (`mkc.trace.Event.tag`), one small frozen class per kind of thing.

A copy's tag is the content it delivers and a read's the content it expects, so the checks can
tell a stale or clobbered slot from a fresh one by equality; the other tags name the op, layer
or pool view an event begins or ends (a collective event's tag is its step,
`mkc.steps.collectives`). Every tag describes itself for diagnostics (`str(tag)`), and a
content tag says how the step-time model prices a read of it (`cost`), so neither the checks
nor the simulator take a tag apart.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar


class ReadCost(enum.Enum):
    """How the step-time model (`mkc.perf.sim`) prices reading a content."""

    NONE = "none"            # no work of its own (vectors, state: the op's work counts them)
    WEIGHTS = "weights"      # per weight value read (the op's matmul and in-kernel decode)
    KV_TILE = "kv tile"      # per KV tile read (the op's attention over one tile)


@dataclass(frozen=True, slots=True)
class Content:
    """What a VMEM slot holds: delivered by a copy or a write, expected by a read."""

    cost: ClassVar[ReadCost] = ReadCost.NONE

    def matrix(self, kind: str) -> str | None:
        """The `ScheduleIR.matrix_facts` entry of the weights read (None: priced as bf16)."""
        return None

    def weights(self, kind: str, nbytes: int) -> tuple[tuple[str | None, int], ...]:
        """What a read of `nbytes` of it reads, as (`matrix_facts` entry, bytes) per matrix."""
        return ((self.matrix(kind), nbytes),)


@dataclass(frozen=True, slots=True)
class RingTile(Content):
    """Tile `index` of the weight stream, in stream order over the whole step."""

    index: int
    # A tile of 8-bit codes (`mkc.layers.dense_formats`): its family ("kind.family", a
    # `matrix_facts` entry) and the bytes of scale rows it carries, which are not multiplied.
    matrix: str | None = None
    scale_bytes: int = 0
    cost: ClassVar[ReadCost] = ReadCost.WEIGHTS

    def weights(self, kind: str, nbytes: int) -> tuple[tuple[str | None, int], ...]:
        if self.matrix is None:
            return ((None, nbytes),)
        return ((self.matrix, max(0, nbytes - self.scale_bytes)),)

    def __str__(self) -> str:
        return f"weight tile {self.index}"


@dataclass(frozen=True, slots=True)
class LayerMatrix(Content):
    """A layer's matrix copied whole into a pool view."""

    layer: int
    name: str
    cost: ClassVar[ReadCost] = ReadCost.WEIGHTS

    def matrix(self, kind: str) -> str | None:
        return f"{kind}.{self.name}"

    def __str__(self) -> str:
        return f"{self.name} of layer {self.layer}"


@dataclass(frozen=True, slots=True)
class RoutedExpert(Content):
    """The `expert`-th routed expert a layer runs (in the order it runs them): all its matrices,
    which one copy brings into its slot. `matrices` gives each one's name and bytes: a read
    prices them apart (FP8 codes are multiplied, their scales are not)."""

    layer: int
    expert: int
    matrices: tuple[tuple[str, int], ...] = ()
    cost: ClassVar[ReadCost] = ReadCost.WEIGHTS

    def weights(self, kind: str, nbytes: int) -> tuple[tuple[str | None, int], ...]:
        """A read of the expert reads each matrix (none for a read of 0 bytes: the checks')."""
        return tuple((f"{kind}.expert.{name}", n) for name, n in self.matrices) if nbytes else ()

    def __str__(self) -> str:
        return f"routed expert {self.expert} of layer {self.layer}"


@dataclass(frozen=True, slots=True)
class KvTile(Content):
    layer: int
    tile: int
    cost: ClassVar[ReadCost] = ReadCost.KV_TILE

    def __str__(self) -> str:
        return f"KV tile {self.tile} of layer {self.layer}"


@dataclass(frozen=True, slots=True)
class LayerVectors(Content):
    """A layer's block of parity vectors (norm weights, biases)."""

    layer: int

    def __str__(self) -> str:
        return f"the vectors of layer {self.layer}"


@dataclass(frozen=True, slots=True)
class LayerState(Content):
    """A layer's recurrent state in VMEM: as its load delivered it, or as its ops updated it."""

    layer: int
    updated: bool = False

    def __str__(self) -> str:
        return f"the state of layer {self.layer} as {'updated' if self.updated else 'loaded'}"


@dataclass(frozen=True, slots=True)
class WholeBuffer(Content):
    """What the prologue puts in a buffer of one slot (the embedded rows, the head norm)."""

    buffer: str

    def __str__(self) -> str:
        return self.buffer


@dataclass(frozen=True, slots=True)
class StateRegion:
    """A layer's recurrent state in HBM: the region a state copy reads or writes."""

    state: str
    layer: int

    def __str__(self) -> str:
        return f"state.{self.state} of layer {self.layer}"


@dataclass(frozen=True, slots=True)
class ViewLayer:
    """The layer a pool view is opened or closed for, as diagnostics name it."""

    layer: int
    label: str

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True, slots=True)
class OpBegins:
    """An op of the model graph begins (kind "tail" for embed, final_norm and lm_head)."""

    kind: str
    op: str
    layer: int

    def __str__(self) -> str:
        return f"{self.kind}.{self.op}"


@dataclass(frozen=True, slots=True)
class LayerBegins:
    kind: str
    layer: int

    def __str__(self) -> str:
        return f"layer {self.layer} ({self.kind})"

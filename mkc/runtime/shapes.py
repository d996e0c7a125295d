"""A generated module's shape tables: data, with the kernel's batch axes as named dims.

A module states its HBM inputs, states, VMEM inputs and scratch once, as tables whose shapes
hold `ROWS` (the rows of the kernel built: B, or S * R for a verify step) and `SEQS` (its
sequences, S) where a dim follows the batch; `mkc.runtime.host.Host` fixes them per kernel.
Scratch entries are `vmem(...)`, `smem(...)` and `dma_sems(...)`, made into Pallas' memory
and semaphore types at a batch (`Scratch.at`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jax.experimental.pallas import tpu as pltpu


@dataclass(frozen=True)
class BatchAxis:
    """A dim fixed per compiled kernel: its rows or its sequences."""

    name: str

    def __repr__(self) -> str:
        return self.name


ROWS = BatchAxis("ROWS")
SEQS = BatchAxis("SEQS")

Shape = tuple[Any, ...]
Shapes = dict[str, tuple[tuple[int, ...], Any]]


def at(shape: Shape, rows: int, seqs: int | None = None) -> tuple[int, ...]:
    """`shape` with ROWS and SEQS fixed (SEQS defaults to the rows: a decode step)."""
    fixed = {ROWS: rows, SEQS: rows if seqs is None else seqs}
    return tuple(fixed.get(d, d) if isinstance(d, BatchAxis) else d for d in shape)


def table_at(table: Mapping[str, tuple[Shape, Any]], rows: int, seqs: int | None = None) -> Shapes:
    """A (shape, dtype) table with its batch axes fixed."""
    return {name: (at(shape, rows, seqs), dtype) for name, (shape, dtype) in table.items()}


@dataclass(frozen=True)
class Scratch:
    """One scratch operand of the kernel, before its batch is fixed; `rows`: the kernel widths
    (inclusive) that allocate it (None: every kernel)."""

    space: str                 # "vmem" | "smem" | "dma_sems"
    shape: Shape
    dtype: Any = None
    rows: tuple[int, int] | None = None

    def exists_at(self, rows: int) -> bool:
        return self.rows is None or self.rows[0] <= rows <= self.rows[1]

    def at(self, rows: int):
        shape = at(self.shape, rows)
        if self.space == "dma_sems":
            return pltpu.SemaphoreType.DMA(shape)
        return (pltpu.VMEM if self.space == "vmem" else pltpu.SMEM)(shape, self.dtype)


def vmem(shape: Shape, dtype, rows: tuple[int, int] | None = None) -> Scratch:
    return Scratch("vmem", tuple(shape), dtype, rows)


def smem(shape: Shape, dtype) -> Scratch:
    return Scratch("smem", tuple(shape), dtype)


def dma_sems(shape: Shape = (), rows: tuple[int, int] | None = None) -> Scratch:
    """DMA semaphores, one per entry of `shape` (one for `()`)."""
    return Scratch("dma_sems", tuple(shape), rows=rows)

"""What a family's compute bodies see: the kernel's refs and the schedule's mechanisms, bound
to one layer.

A generated module builds one `Kernel` per invocation and, per layer, `kernel.layer(kind,
index)`. Compute bodies (a family's `lowering` module) ask it for their layer's vectors, state
buffers, matrices and KV cache by name; which mechanism serves a matrix (ring stream or pool
view) is the schedule's choice, not the body's.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc import ir
from mkc.runtime import collectives, experts, kv, pool, ring, vectors
from mkc.steps.copies import copy_name


def spread_on_host(batch_axis: int, ndim: int) -> bool:
    """Whether a verify step's input state comes already spread over every row's entry (its S
    states in the first S, the rest unused) rather than as S entries the kernel loads into the
    first S. The kernel cannot load S entries when rows are a tiled (last two) dim: a slice
    of a tile is no DMA target (Mosaic: "slice sizes along tiled dimensions must be aligned")."""
    return batch_axis >= ndim - 2


@dataclass(frozen=True)
class StateCopy:
    """A state copy the schedule names: HBM array `hbm` (one slice per layer of the kind) to or
    from VMEM buffer `buffer`, signalling its own semaphore (`sem`)."""

    direction: str       # "load" | "store"
    hbm: str
    buffer: str
    batch_axis: int = 0  # the buffer's batch (row) axis

    @property
    def name(self) -> str:
        return copy_name(self.direction, self.buffer)

    @property
    def sem(self) -> str:
        return f"sem__{self.name}"


@dataclass(frozen=True)
class KindPlan:
    """The schedule of one layer kind as its compute bodies need it."""

    streamed: Mapping[str, tuple[int, ring.StreamedMatrix]]   # family -> (first tile in layer, tiling)
    states: Mapping[str, str]                 # state family -> VMEM buffer
    copies: tuple[StateCopy, ...]             # by name (`StateCopy.name`, "load_conv_buf")
    caches: tuple[str, ...] = ()              # HBM caches, in the order bodies pass new rows
    kv: kv.KvTiles | None = None
    kv_rows: str = ""                         # VMEM tile buffer of the KV row writes
    kv_tiles: tuple[str, ...] = ()            # `at layer start`: each cache's tile buffer,
                                              # scoped by the layer; its semaphores `sem__<it>`
    # `refill` (`mkc.ir.RingRefill`): (tiles, from_rows, to_rows), the layer's first tiles
    # whose ring refills wait for `refill_ring` in kernels of from_rows to to_rows rows (0: any);
    # () for none
    refill: tuple[int, int, int] = ()

    @property
    def kv_sem(self) -> str:
        return f"sem__{self.kv_rows}"

    def copy(self, name: str) -> StateCopy:
        return next(c for c in self.copies if c.name == name)


@dataclass(frozen=True)
class Kernel:
    """One kernel invocation: its refs by name, batch and the step-wide mechanisms.

    B rows run as R rows per sequence of S = B / R sequences, wave-major: row r * S + s is
    sequence s's r-th row (consecutive positions). Decoding is R = 1. A verify kernel (verify
    True) leaves the step's input states untouched and keeps the state after every row: its
    state buffers hold one state per row, in row order, and its state loads read the inputs."""

    refs: types.SimpleNamespace
    B: int
    axis: str
    dims: Any
    per_rank: Mapping[str, int]
    kinds: Mapping[str, KindPlan]
    ring: ring.Ring
    ring_refs: ring.RingRefs
    parity: vectors.Parity
    vector_refs: vectors.VectorRefs
    # the routed experts' slots: one layout, or per layer kind where kinds hold them in several
    experts: experts.ExpertSlots | Mapping[str, experts.ExpertSlots] | None = None
    view: pool.WeightView | None = None        # the weight view the layers prefetch into
    kind_ids: Mapping[str, int] | None = None
    R: int = 1                                 # rows per sequence
    verify: bool = False
    formats: Mapping[str, str] = dataclasses.field(default_factory=dict)   # matrix class -> format

    @property
    def S(self) -> int:
        """Sequences."""
        return self.B // self.R

    def experts_of(self, kind: str) -> experts.ExpertSlots:
        """The slots layer kind `kind` fetches its routed experts into."""
        return self.experts[kind] if isinstance(self.experts, Mapping) else self.experts

    @property
    def layers(self) -> int:
        """Iterations of the layer loop."""
        return len(self.dims.layer_kinds)

    def run_layers(self, bodies: Mapping[str, Callable[["Kernel", Any], None]]) -> None:
        """Every layer in order, each by its kind's body: the SMEM layer table's kind column
        picks one of `bodies` (kind -> body(kernel, layer)) per iteration of one loop."""
        tables = self.refs.tables

        def layer_step(layer, carry):
            for kind, body in bodies.items():
                pl.when(tables[0, layer] == self.kind_ids[kind])(functools.partial(body, self, layer))
            return carry
        lax.fori_loop(0, self.layers, layer_step, 0)

    def layer(self, kind: str, index) -> "Layer":
        tables = self.refs.tables
        return Layer(self, self.refs, kind, self.kinds[kind], index, si=tables[2, index],
                     first_tile=tables[1, index])

    def allreduce(self, partial: jax.Array,
                  stages: tuple[collectives.AllReduceStage, ...] | collectives.FromRows) -> jax.Array:
        return collectives.allreduce(self.refs, partial, stages, self.axis)

    def start_allreduce(self, partial: jax.Array, stages: tuple[collectives.AllReduceStage, ...]
                        | collectives.FromRows) -> collectives.InFlight:
        return collectives.start_allreduce(self.refs, partial, stages, self.axis)

    def start_allgather(self, shard: jax.Array, stage: collectives.Stage) -> collectives.InFlight:
        return collectives.start_gather(self.refs, shard, stage, self.axis)

    def allgather(self, shard: jax.Array, stage: collectives.Stage) -> jax.Array:
        """The group's shards of `shard` concatenated in group order."""
        return collectives.gather(self.refs, shard, stage, self.axis)

    def exchange(self, share: jax.Array, stage: collectives.Stage) -> jax.Array:
        """`exchange OP with sibling`: the cores of a chip swap their shares of the op's columns,
        an all-gather over the group of the chip's cores (`stage`)."""
        return self.allgather(share, stage)

    def start_view(self, layer) -> None:
        """Copy loop layer `layer`'s pooled matrices into the weight view."""
        pool.start_view(self.view, self.refs, self.kind_ids, layer)


@dataclass(frozen=True)
class Layer:
    """One layer of a kind, as its compute bodies see it."""

    kernel: Kernel
    refs: types.SimpleNamespace        # the kernel's refs, plus the scoped buffers open here
    kind: str
    plan: KindPlan
    index: Any                         # the layer (traced)
    si: Any                            # its index among the layers of its kind (traced)
    first_tile: Any                    # its first ring tile (traced)

    @property
    def B(self) -> int:
        return self.kernel.B

    @property
    def S(self) -> int:
        return self.kernel.S

    @property
    def R(self) -> int:
        return self.kernel.R

    @property
    def dims(self) -> Any:
        return self.kernel.dims

    def sequence(self, b: int) -> int:
        """The sequence of row b (its KV cache)."""
        return b % self.S

    def state_source(self, b: int) -> int:
        """The state-buffer entry row b starts from: the previous row of its sequence, or for a
        sequence's first row the loaded state, which sits in entry b (so updates are in place
        when decoding)."""
        return b - self.S if b >= self.S else b

    def waves(self) -> list[tuple[slice, slice]]:
        """(rows, their source entries) per wave of rows, for ops that update a state a whole
        wave at a time: wave r's rows are r * S .. (r + 1) * S and start from the previous
        wave's entries (the first wave from its own, loaded, entries)."""
        S = self.S
        return [(slice(r * S, (r + 1) * S), slice(max(r - 1, 0) * S, max(r, 1) * S))
                for r in range(self.R)]

    @property
    def per_rank(self) -> Mapping[str, int]:
        return self.kernel.per_rank

    @property
    def experts(self) -> experts.ExpertSlots:
        """The slots this kind fetches its routed experts into."""
        return self.kernel.experts_of(self.kind)

    def weight_format(self, cls: str):
        """The format of matrix class `cls` in this kind (its experts' own, where it holds
        them in another layout)."""
        own = self.experts.formats if cls.startswith("expert.") else {}
        return own.get(cls) or self.kernel.formats[cls]

    def scoped(self, **buffers) -> "Layer":
        """This layer with scoped buffers (from `pl.run_scoped`) added to its refs."""
        return dataclasses.replace(self, refs=types.SimpleNamespace(**vars(self.refs), **buffers))

    def vector(self, name: str) -> jax.Array:
        return vectors.vector(self.kernel.parity, self.kernel.vector_refs, self.kind, name, self.index)

    def vectors_arrive(self) -> None:
        """Wait for this layer's vectors and issue the ones `ahead` layers on."""
        vectors.arrive(self.kernel.parity, self.kernel.vector_refs, self.index, self.kernel.layers)

    def state(self, name: str):
        """The VMEM buffer holding this layer's state family `name`."""
        return getattr(self.refs, self.plan.states[name])

    def copy(self, name: str, previous: bool = False):
        """The state copy `name` of this layer (or of the previous layer of the kind)."""
        cp = self.plan.copy(name)
        vmem, sem = getattr(self.refs, cp.buffer), getattr(self.refs, cp.sem)
        si = self.si - 1 if previous else self.si
        if cp.direction == "store":
            return pltpu.make_async_copy(vmem, getattr(self.refs, cp.hbm).at[si], sem)
        if not self.kernel.verify or spread_on_host(cp.batch_axis, len(vmem.shape)):
            return pltpu.make_async_copy(getattr(self.refs, cp.hbm).at[si], vmem, sem)
        # A verify kernel's output holds a state per row; the S input states land in the
        # first wave's entries (the leading S along the batch axis).
        entries = (slice(None),) * cp.batch_axis + (pl.ds(0, self.S),)
        return pltpu.make_async_copy(getattr(self.refs, cp.hbm + "_in").at[si], vmem.at[entries], sem)

    def matmul(self, name: str, h: jax.Array) -> jax.Array:
        """h @ matrix family `name` of this layer -> f32 [B, columns]: from the ring (padded to
        whole tiles) or, for a pooled matrix, from the weight view (exact columns)."""
        if name in self.plan.streamed:
            offset, tiling = self.plan.streamed[name]
            refills = None
            if self._refills_held() and offset < self.plan.refill[0]:
                refills = ir.held_refills(self.plan.refill[0], self.kernel.ring.ahead).start - offset
            return ring.matmul(self.kernel.ring, self.kernel.ring_refs, h, self.first_tile + offset,
                               tiling, refills)
        row, rows, cols, _ = self.kernel.view.matrices[self.kind][name]
        return pool.pooled_matmul(h, getattr(self.refs, self.kernel.view.pool), row, rows, cols)

    def pooled(self, name: str) -> jax.Array:
        """Pooled matrix `name` of this layer as a bf16 value (for bodies that read a weight
        whole rather than multiply by it)."""
        row, rows, cols, _ = self.kernel.view.matrices[self.kind][name]
        return pool.pooled_bf16(getattr(self.refs, self.kernel.view.pool), row, rows, cols)

    def wait_pooled(self, name: str) -> None:
        pool.wait_matrix(self.kernel.view, self.refs, self.kind, name, self.si)

    def _refills_held(self) -> bool:
        return bool(self.plan.refill) and ir.rows_within(self.B, *self.plan.refill[1:])

    def refill_ring(self) -> None:
        """Start the ring refills held back for this layer's first tiles (`refill`)."""
        if self._refills_held():
            ring.start_after(self.kernel.ring, self.kernel.ring_refs, self.first_tile,
                             self.plan.refill[0])

    def prefetch_view(self) -> None:
        """Start the next loop layer's pooled matrices into the weight view."""
        @pl.when(self.index + 1 < self.kernel.layers)
        def _():
            self.kernel.start_view(self.index + 1)

    def _caches(self) -> list:
        return [getattr(self.refs, n) for n in self.plan.caches]

    def _early_kv(self) -> kv.Early | None:
        """The KV tiles copied from the layer's start (`at layer start`), if so scheduled."""
        if not self.plan.kv.at_start:
            return None
        return kv.Early([getattr(self.refs, n) for n in self.plan.kv_tiles],
                        [getattr(self.refs, f"sem__{n}") for n in self.plan.kv_tiles])

    def kv_start(self) -> None:
        """Start the copies of this layer's first KV tiles (`at layer start`)."""
        kv.start_first(self.plan.kv, self._caches(), self.si,
                       kv.tile_count(self.plan.kv, self.refs.positions, self.B), self._early_kv())

    def kv_write(self, new: list[jax.Array]) -> None:
        """Write each row's new cache entries (one [B, width] array per cache) at its position."""
        early = self._early_kv()
        kv.write_rows(self._caches(), getattr(self.refs, self.plan.kv_rows),
                      getattr(self.refs, self.plan.kv_sem), self.si, self.refs.positions, new,
                      self.S, self.R, self.plan.kv.ring,
                      None if early is None else (self.plan.kv, early))

    def kv_positions(self, tokens: jax.Array, position) -> jax.Array:
        """The position each cache slot of a KV tile's `tokens` holds for a row at `position`
        (the slot, or in a window's KV ring the latest position written to it; negative:
        none yet): what a body masks by (mkc.runtime.kv.held)."""
        return kv.held(self.plan.kv, tokens, position)

    def kv_fold(self, body: Callable, init):
        """Fold body(t, tiles, tokens, carry) over this layer's cached tokens (mkc.runtime.kv)."""
        return kv.stream(self.plan.kv, self._caches(), self.si, self.refs.positions, self.B, body,
                         init, self._early_kv())

    # ---- routed experts (mkc.runtime.experts) ------------------------------------------------
    def select_experts(self, ids: jax.Array) -> None:
        """List this rank's picked local experts (ids [B, top_k], global) in SMEM."""
        experts.select_local(self.experts, self.refs, ids, self.kernel.axis, self.B)

    def start_experts(self) -> None:
        experts.start_first(self.experts, self.refs, self.si)

    def fold_experts(self, body: Callable, init):
        """Fold body(k, carry) over the selected experts, each once its slot has landed."""
        return experts.fold(self.experts, self.refs, self.si, body, init)

    def expert_matmul(self, k, name: str, h: jax.Array) -> jax.Array:
        """h @ selected expert k's matrix `name` (from its slot) -> f32 [B, cols]."""
        row, rows, cols = experts.matrix(self.experts, self.refs, k, name)
        return pool.pooled_matmul(h, getattr(self.refs, self.experts.pool), row, rows, cols)

    def expert_weight(self, weights: jax.Array, k) -> jax.Array:
        """The routing weight [B, 1] of selected expert k (weights [B, E])."""
        es = self.experts
        return experts.expert_weight(weights, experts.global_id(es, self.refs, k, self.kernel.axis))

"""Expert slots: routed experts copied into a pool's slot view as routing picks them.

Each rank serves the experts of its expert group (`group_size` consecutive ranks share one
group's experts, each holding a slice of their width). After routing, `select_local` lists in
SMEM the distinct local experts any row picked, in ascending id order. Selected expert k lands
in slot k % slots: the first `slots` are started as soon as they are known (`start_first`),
and `fold` runs them in order, starting expert k + slots into expert k's slot as soon as k has
been consumed (the slot protocol `mkc.checks` proves race-free).

An expert's matrices sit at fixed row offsets inside its slot, in the pool layout of
`mkc.runtime.pool` (the `stacked` ones, block scales, in its stacked form). HBM holds the
slot's image (`experts_hbm`, [layers of the kind, local experts, slot rows, 128] bf16:
`pack_expert`), so fetching an expert is one contiguous DMA on one semaphore per slot,
whatever its matrices' widths. A layer kind that holds its experts in another layout (Muse
Spark's layers the NVFP4 release keeps bf16) has slots of its own, in a view of its own, and an
HBM input of its own (`input_name`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc.runtime import pool, scopes


@dataclass(frozen=True)
class ExpertSlots:
    pool: str                                   # the pool buffer
    slots: int
    slot_rows: int                              # pool rows per slot
    matrices: dict[str, tuple[int, int, int]]   # name -> (first row in the slot, rows, cols)
    local_experts: int                          # experts per group
    group_size: int                             # ranks sharing one group's experts
    top_k: int
    stacked: tuple[str, ...] = ()               # matrices stored stacked (`pool.pack_stacked`)
    hbm: str = "experts_hbm"                    # the kernel input holding their slot images
    # A layer kind that holds its experts in another layout than the module's first: its
    # expert classes' formats (over the module's `FORMATS`)
    formats: Mapping[str, Any] = field(default_factory=dict)


HBM = "experts_hbm"       # the kernel input holding every local expert's slot image


def input_name(kind: str, first: bool) -> str:
    """The HBM input of a layer kind's routed experts (its layers' slot images): `experts_hbm`
    for the first kind that fetches them, `experts_hbm__KIND` for each other."""
    return HBM if first else f"{HBM}__{kind}"


def pack_expert(es: ExpertSlots, matrices: dict[str, np.ndarray]) -> np.ndarray:
    """Host side: one expert's matrices (name -> [rows, cols] bf16 or uint8) -> its HBM form,
    bf16 [slot_rows, 128], each matrix in pool rows (`pool.pack_rows`, or `pool.pack_stacked`)
    at its row in the slot: byte for byte what the slot holds once the expert's one copy lands
    (padding zero)."""
    if set(matrices) != set(es.matrices):
        raise ValueError(f"an expert's matrices are {sorted(es.matrices)}, got {sorted(matrices)}")
    out = np.zeros((es.slot_rows, pool.LANES), ml_dtypes.bfloat16)
    for name, (row, rows, cols) in es.matrices.items():
        if np.shape(matrices[name]) != (rows, cols):
            raise ValueError(f"expert matrix {name} is {np.shape(matrices[name])}, the slot "
                             f"holds ({rows}, {cols})")
        packed = (pool.pack_stacked if name in es.stacked else pool.pack_rows)(matrices[name])
        out[row:row + packed.shape[0]] = packed
    return out


def top_k(pick: jax.Array, values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Per row, the k lanes of largest `pick` -> (`values` at those lanes and zero elsewhere,
    their ids [B, k] int32 best first, ties to the lowest lane, as lax.top_k orders them).
    Mosaic cannot lower lax.top_k: this takes k rounds of a max and the lowest matching lane."""
    n = pick.shape[1]
    lane = lax.broadcasted_iota(jnp.int32, pick.shape, 1)
    slot = lax.broadcasted_iota(jnp.int32, (pick.shape[0], k), 1)
    kept = jnp.zeros_like(values)
    ids = jnp.zeros((pick.shape[0], k), jnp.int32)
    for j in range(k):
        best = jnp.max(pick, axis=-1, keepdims=True)
        idx = jnp.min(jnp.where(pick == best, lane, n), axis=-1, keepdims=True)   # [B, 1]
        hit = lane == idx
        kept = jnp.where(hit, values, kept)
        pick = jnp.where(hit, -jnp.inf, pick)
        ids = jnp.where(slot == j, idx, ids)
    return kept, ids


def expert_id(ids: jax.Array, row: int, slot: int) -> jax.Array:
    """Scalar int32 ids[row, slot] (a masked full reduction: the vector-to-scalar move that
    lowers), to store in SMEM before issuing expert DMAs."""
    mask = ((lax.broadcasted_iota(jnp.int32, ids.shape, 0) == row)
            & (lax.broadcasted_iota(jnp.int32, ids.shape, 1) == slot))
    return jnp.sum(jnp.where(mask, ids, 0))


def expert_weight(weights: jax.Array, expert) -> jax.Array:
    """Column [B, 1] of the routing weights [B, E] for one (dynamic) expert id: a lane mask and
    sum, as vector gathers do not lower. Zero for rows not routed to it."""
    lane = lax.broadcasted_iota(jnp.int32, weights.shape, 1)
    return jnp.sum(jnp.where(lane == expert, weights, 0.0), axis=-1, keepdims=True)


def group(es: ExpertSlots, axis: str):
    return lax.div(lax.axis_index(axis), es.group_size)


def select_local(es: ExpertSlots, refs, ids: jax.Array, axis: str, B: int) -> None:
    """expert_list[:count] = the distinct experts of this rank's group that any row picked
    (ids [B, top_k], global ids), as local ids in ascending order; count -> expert_count[0]."""
    g = group(es, axis)
    for e in range(es.local_experts):
        refs.expert_list[e] = 0
    for b in range(B):
        for j in range(es.top_k):
            e = expert_id(ids, b, j)

            @pl.when(lax.div(e, es.local_experts) == g)
            def _():
                refs.expert_list[lax.rem(e, es.local_experts)] = 1

    def compact(e, count):
        picked = refs.expert_list[e]
        refs.expert_list[count] = e          # count <= e: never overwrites an unread flag
        return count + picked

    refs.expert_count[0] = lax.fori_loop(0, es.local_experts, compact, 0)


def global_id(es: ExpertSlots, refs, k, axis: str):
    """The model-wide id of selected expert k of this rank's group."""
    return refs.expert_list[k] + es.local_experts * group(es, axis)


def _slot_row(es: ExpertSlots, k):
    """The first pool row of selected expert k's slot, k % slots (a whole tile in)."""
    return pl.multiple_of(lax.rem(k, es.slots) * es.slot_rows, pool.TILE_ROWS)


def _copy(es: ExpertSlots, refs, si, k):
    """Selected expert k's one copy: its slot image in HBM into its slot of the pool."""
    return pltpu.make_async_copy(getattr(refs, es.hbm).at[si, refs.expert_list[k]],
                                 getattr(refs, es.pool).at[pl.ds(_slot_row(es, k), es.slot_rows)],
                                 refs.expert_sem.at[lax.rem(k, es.slots)])


def start(es: ExpertSlots, refs, si, k) -> None:
    _copy(es, refs, si, k).start()


def start_first(es: ExpertSlots, refs, si) -> None:
    """Start the first `slots` selected experts (as soon as routing is known)."""
    for k in range(es.slots):
        @pl.when(k < refs.expert_count[0])
        def _():
            start(es, refs, si, k)


def matrix(es: ExpertSlots, refs, k, name: str) -> tuple[int, int, int]:
    """(first pool row, rows, cols) of selected expert k's matrix `name` in its slot."""
    row, rows, cols = es.matrices[name]
    return _slot_row(es, k) + row, rows, cols


def read_u8(es: ExpertSlots, refs, k, name: str) -> jax.Array:
    """Selected expert k's whole uint8 matrix `name` as a value, in whichever layout it has."""
    row, rows, cols = matrix(es, refs, k, name)
    read = pool.pooled_stacked if name in es.stacked else pool.pooled_u8
    return read(getattr(refs, es.pool), row, rows, cols)


def fold(es: ExpertSlots, refs, si, body: Callable, init):
    """Fold body(k, carry) -> carry over the selected experts in order, each after its copy
    lands; expert k + slots is started into k's slot once k is consumed."""
    def one(k, carry):
        _copy(es, refs, si, k).wait()
        with scopes.weights():        # an expert's work grows with the weights it reads
            out = body(k, carry)

        @pl.when(k + es.slots < refs.expert_count[0])
        def _():
            start(es, refs, si, k + es.slots)
        return out

    return lax.fori_loop(0, refs.expert_count[0], one, init)

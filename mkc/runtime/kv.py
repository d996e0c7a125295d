"""The KV cache of attention layers: the new token's rows written by read-modify-write of an
aligned tile, and the cached tokens streamed through scoped VMEM slots, a few tiles ahead of a
tile body (the op's online softmax).

A cache is HBM ``[layers of the kind, B, context, width]`` bf16. A single bf16 row is not a legal
DMA target on TPU, so a row is written by copying the aligned 16-row tile holding it into VMEM,
replacing the row and copying the tile back.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BF16 = jnp.bfloat16
ROW_TILE = 16            # bf16 rows per (16, 128) tile


@dataclass(frozen=True)
class KvTiles:
    tokens: int          # tokens per tile
    slots: int
    ahead: int


def write_rows(caches: Sequence, rows_buf, sem, si, positions, new: Sequence[jax.Array], B: int) -> None:
    """Write row b of new[c] ([B, width]) at position positions[b] of cache c (layer si): read
    every row's tile, then write them all back (rows_buf: [len(caches), B, 16, width])."""
    row = lax.broadcasted_iota(jnp.int32, rows_buf.shape[2:], 0)
    for phase in ("read", "write"):
        copies = []
        for b in range(B):
            pos = positions[b]
            base = pl.multiple_of((pos // ROW_TILE) * ROW_TILE, ROW_TILE)
            for c, cache in enumerate(caches):
                hbm = cache.at[si, b, pl.ds(base, ROW_TILE)]
                if phase == "read":
                    cp = pltpu.make_async_copy(hbm, rows_buf.at[c, b], sem)
                else:
                    value = new[c][b:b + 1].astype(rows_buf.dtype)
                    rows_buf[c, b] = jnp.where(row == pos - base,
                                               jnp.broadcast_to(value, rows_buf.shape[2:]), rows_buf[c, b])
                    cp = pltpu.make_async_copy(rows_buf.at[c, b], hbm, sem)
                cp.start()
                copies.append(cp)
        for cp in copies:
            cp.wait()


def stream(kv: KvTiles, caches: Sequence, si, positions, B: int,
           body: Callable, init):
    """Fold `body(t, tiles, tokens, carry) -> carry` over the cache tiles up to the largest row
    position: `tiles[c]` is cache c's tile t in VMEM ([B, tokens, width]), `tokens` the token
    index of each of its rows ([1, tokens]). Tiles stream through kv.slots scoped slots per
    cache, kv.ahead tiles ahead."""
    last = positions[0]
    for b in range(1, B):
        last = jnp.maximum(last, positions[b])
    n_tiles = last // kv.tokens + 1

    def scoped(*scratch):
        bufs, sems = scratch[:len(caches)], scratch[len(caches):]

        def copies(t):
            slot = lax.rem(t, kv.slots)
            src = pl.ds(t * kv.tokens, kv.tokens)
            return [pltpu.make_async_copy(cache.at[si, :, src], buf.at[slot], sem.at[slot])
                    for cache, buf, sem in zip(caches, bufs, sems)]

        for a in range(kv.ahead):
            @pl.when(a < n_tiles)
            def _():
                for cp in copies(a):
                    cp.start()

        def tile(t, carry):
            for cp in copies(t):
                cp.wait()
            slot = lax.rem(t, kv.slots)
            tokens = t * kv.tokens + lax.broadcasted_iota(jnp.int32, (1, kv.tokens), 1)
            out = body(t, [buf.at[slot] for buf in bufs], tokens, carry)

            @pl.when(t + kv.ahead < n_tiles)
            def _():
                for cp in copies(t + kv.ahead):
                    cp.start()
            return out

        return lax.fori_loop(0, n_tiles, tile, init)

    shapes = [pltpu.VMEM((kv.slots, B, kv.tokens, cache.shape[-1]), cache.dtype) for cache in caches]
    sems = [pltpu.SemaphoreType.DMA((kv.slots,)) for _ in caches]
    return pl.run_scoped(scoped, *shapes, *sems)

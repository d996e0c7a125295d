"""The KV cache of attention layers: the new token's rows written by read-modify-write of an
aligned tile, and the cached tokens streamed through scoped VMEM slots, a few tiles ahead of a
tile body (the op's online softmax).

A cache is HBM ``[layers of the kind, S, context, width]`` bf16: one per sequence. A layer kind
that attends to its last W positions only may keep it as a window's KV ring (`kv ring N slots`,
``KvTiles.ring``): ``[layers, S, N, width]``, position p in slot p % N, whatever the context;
its tiles stream the whole ring once it has wrapped, and `held` gives the position each slot
holds for a row, which the compute body masks by. A kernel runs
R rows per sequence (1 when decoding, R when verifying drafts), ordered row-major by wave: row
``r * S + s`` is sequence s's r-th row, at consecutive positions. A single bf16 row is not a
legal DMA target on TPU, so a sequence's new rows are written by copying the aligned 16-row
tiles holding them into VMEM, replacing the rows and copying the tiles back.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc import ir
from mkc.runtime import scopes

BF16 = jnp.bfloat16
ROW_TILE = ir.SUBLANE_TILE["bf16"]    # bf16 rows per (16, 128) tile


@dataclass(frozen=True)
class KvTiles:
    tokens: int          # tokens per tile
    slots: int
    ahead: int
    ring: int = 0        # a window's KV ring of this many token slots (0: the context's)
    # `at layer start`: the first `ahead` tiles' copies start as the layer begins, into
    # buffers and semaphores the layer holds (`Early`); `write_rows` waits them
    at_start: bool = False


@dataclass(frozen=True)
class Early:
    """KV tiles copied from the layer's start: each cache's tile buffer ([slots, S, tokens,
    width]) and DMA semaphores ([slots])."""

    bufs: Sequence
    sems: Sequence


def tile_count(kv: KvTiles, positions, B: int) -> jax.Array:
    """Tiles streamed: those up to the largest position of the B rows (a window's KV ring's
    up to all of them once it has wrapped)."""
    last = positions[0]
    for b in range(1, B):
        last = jnp.maximum(last, positions[b])
    n_tiles = last // kv.tokens + 1
    if kv.ring:
        n_tiles = jnp.minimum(n_tiles, kv.ring // kv.tokens)
    return n_tiles


def tile_copies(kv: KvTiles, caches: Sequence, si, bufs: Sequence, sems: Sequence, t) -> list:
    """Tile t of every cache into its slot t % slots."""
    slot = lax.rem(t, kv.slots)
    src = pl.ds(t * kv.tokens, kv.tokens)
    return [pltpu.make_async_copy(cache.at[si, :, src], buf.at[slot], sem.at[slot])
            for cache, buf, sem in zip(caches, bufs, sems)]


def start_first(kv: KvTiles, caches: Sequence, si, n_tiles, early: Early) -> None:
    """Start the first `ahead` tiles' copies (those of the `n_tiles` the rows reach)."""
    for a in range(kv.ahead):
        @pl.when(a < n_tiles)
        def _():
            for cp in tile_copies(kv, caches, si, early.bufs, early.sems, a):
                cp.start()


def held(kv: KvTiles, tokens: jax.Array, position) -> jax.Array:
    """The position each cache slot of `tokens` holds for a row at `position`: the slot
    itself, or in a window's ring of N slots the latest position q <= position written to it
    (q % N == slot; negative while the ring has not reached the slot)."""
    if not kv.ring:
        return tokens
    return position - lax.rem(position - tokens + kv.ring, kv.ring)


def write_rows(caches: Sequence, rows_buf, sem, si, positions, new: Sequence[jax.Array],
               S: int, R: int = 1, ring: int = 0, early: tuple[KvTiles, Early] | None = None
               ) -> None:
    """Write row b of new[c] ([S * R, width]) at position positions[b] of cache c (layer si) in
    its sequence b % S. Each sequence's rows are consecutive positions, inside W =
    ir.kv_window_tiles(R) aligned tiles: all tiles are read, the rows replaced, and all written
    back, so rows sharing a tile never overwrite each other. rows_buf is [len(caches), S * R, 16,
    width]; sequence s's tiles use its entries s + w * S (W <= R). The window is clamped to end
    at the context, which holds every row because the last position is below it. In a window's
    KV ring of `ring` slots (a multiple of the tile) row b goes to slot positions[b] % ring and
    the tiles wrap: tile w is the (first tile + w) % (ring / 16)-th, at most the ring's tiles,
    so none is read twice. With `early` (`at layer start`), the first tiles' copies are waited
    before any row is written back (so none reads HBM a write changes) and each row is
    written into the tile holding it in VMEM too (`_patch_early`)."""
    W = ir.kv_window_tiles(R)
    context = caches[0].shape[2]        # token slots: the context, or the ring's
    if ring:
        W = min(W, ring // ROW_TILE)
    row = lax.broadcasted_iota(jnp.int32, rows_buf.shape[2:], 0)

    def slot(b):
        return lax.rem(positions[b], ring) if ring else positions[b]

    for phase in ("read", "write"):
        if phase == "write" and early is not None:
            _patch_early(*early, caches, si, positions, new, S, R)
        copies = []
        for s in range(S):
            first = slot(s)
            if ring:
                base = (first // ROW_TILE) * ROW_TILE
            else:
                base = jnp.minimum((first // ROW_TILE) * ROW_TILE, context - W * ROW_TILE)
            for w in range(W):
                at = lax.rem(base + w * ROW_TILE, ring) if ring else base + w * ROW_TILE
                start = pl.multiple_of(at, ROW_TILE)
                for c, cache in enumerate(caches):
                    hbm = cache.at[si, s, pl.ds(start, ROW_TILE)]
                    tile = rows_buf.at[c, s + w * S]
                    if phase == "read":
                        cp = pltpu.make_async_copy(hbm, tile, sem)
                    else:
                        block = rows_buf[c, s + w * S]
                        for r in range(R):
                            value = new[c][r * S + s:r * S + s + 1].astype(rows_buf.dtype)
                            block = jnp.where(row == slot(r * S + s) - start,
                                              jnp.broadcast_to(value, block.shape), block)
                        rows_buf[c, s + w * S] = block
                        cp = pltpu.make_async_copy(tile, hbm, sem)
                    cp.start()
                    copies.append(cp)
        for cp in copies:
            cp.wait()


def _patch_early(kv: KvTiles, early: Early, caches: Sequence, si, positions,
                 new: Sequence[jax.Array], S: int, R: int) -> None:
    """Wait the first tiles' copies and write row b of new[c] into cache c's tile holding its
    slot, if that is one of them: the aligned 16-row block holding it, read, the row
    replaced, written back."""
    B = S * R
    n_tiles = tile_count(kv, positions, B)
    for a in range(kv.ahead):
        @pl.when(a < n_tiles)
        def _():
            for cp in tile_copies(kv, caches, si, early.bufs, early.sems, a):
                cp.wait()
    row = lax.broadcasted_iota(jnp.int32, (ROW_TILE, early.bufs[0].shape[-1]), 0)
    for b in range(B):
        s = b % S
        slot = lax.rem(positions[b], kv.ring) if kv.ring else positions[b]
        t = slot // kv.tokens
        offset = slot - t * kv.tokens
        base = pl.multiple_of((offset // ROW_TILE) * ROW_TILE, ROW_TILE)

        @pl.when(t < kv.ahead)
        def _():
            for c, buf in enumerate(early.bufs):
                block = buf.at[lax.rem(t, kv.slots), s, pl.ds(base, ROW_TILE)]
                value = new[c][b:b + 1].astype(buf.dtype)
                block[...] = jnp.where(row == offset - base, jnp.broadcast_to(value, block.shape),
                                       block[...])


def stream(kv: KvTiles, caches: Sequence, si, positions, B: int,
           body: Callable, init, early: Early | None = None):
    """Fold `body(t, tiles, tokens, carry) -> carry` over the cache tiles up to the largest
    position of the B rows: `tiles[c]` is cache c's tile t in VMEM ([S, tokens, width], one per
    sequence), `tokens` the token index of each of its rows ([1, tokens]). Tiles stream through
    kv.slots scoped slots per cache, kv.ahead tiles ahead. A window's KV ring streams its tiles
    up to the largest position, or all of them once it has wrapped; `tokens` are its slots then
    (`held` gives their positions). With `early` (`at layer start`) the tiles stream through
    its buffers, the first `ahead` already started and waited (`write_rows`)."""
    n_tiles = tile_count(kv, positions, B)

    def run(bufs: Sequence, sems: Sequence):
        def copies(t):
            return tile_copies(kv, caches, si, bufs, sems, t)

        if early is None:
            start_first(kv, caches, si, n_tiles, Early(bufs, sems))

        def tile(t, carry):
            if early is not None:   # the first `ahead` tiles were waited as the rows were written
                @pl.when(t >= kv.ahead)
                def _():
                    for cp in copies(t):
                        cp.wait()
            else:
                for cp in copies(t):
                    cp.wait()
            slot = lax.rem(t, kv.slots)
            with scopes.kv_tile():
                tokens = t * kv.tokens + lax.broadcasted_iota(jnp.int32, (1, kv.tokens), 1)
                out = body(t, [buf.at[slot] for buf in bufs], tokens, carry)

            @pl.when(t + kv.ahead < n_tiles)
            def _():
                for cp in copies(t + kv.ahead):
                    cp.start()
            return out

        return lax.fori_loop(0, n_tiles, tile, init)

    if early is not None:
        return run(early.bufs, early.sems)
    shapes = [pltpu.VMEM((kv.slots, cache.shape[1], kv.tokens, cache.shape[-1]), cache.dtype)
              for cache in caches]
    sems = [pltpu.SemaphoreType.DMA((kv.slots,)) for _ in caches]
    return pl.run_scoped(lambda *scratch: run(scratch[:len(caches)], scratch[len(caches):]),
                         *shapes, *sems)

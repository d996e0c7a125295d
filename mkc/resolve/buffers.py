"""Pass `buffers`: every VMEM buffer of the kernel, in the order the module declares them:
the ring, the vector block, activations and pools, then each layer kind's, the all-reduce
receive buffers and the logits. Two with one name are refused."""
from __future__ import annotations

from dataclasses import replace

from mkc import ir
from mkc.diagnostics import fail
from mkc.resolve.state import ResolveState


def resolve_buffers(s: ResolveState) -> ResolveState:
    buffers = _core_buffers(s)
    for kname in s.kinds:
        # kinds running the same ops (Muse Spark's moe and moe_bf16) gather them through the
        # same receive buffers: their layers never run at once
        buffers += [*s.kind_buffers[kname], *(b for b in s.collectives[kname].buffers if b not in buffers)]
    buffers += s.reduce_buffers
    tail = s.stream.tail[0]
    buffers.append(ir.Buffer("logits", "output", (tail.col_tiles, s.batch[1], tail.tile_cols),
                             "f32", batch_axis=1))
    names = [b.name for b in buffers]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise fail("E-DUPLICATE", f"buffer '{dup}' is declared twice", s.sched.name.span,
                   hint="give each VMEM buffer its own name")
    return replace(s, buffers=buffers)


def _core_buffers(s: ResolveState) -> list[ir.Buffer]:
    """What every kernel holds whatever its phases: the weight ring, the parity block of
    per-layer vectors, the activations, and the pools."""
    stream, parity, B, H = s.stream, s.parity, s.batch[1], s.dims.hidden_size
    every = [f for fs in stream.families.values() for f in fs] + stream.tail
    buffers = [
        ir.Buffer(stream.ring, "ring", (stream.slots, stream.tile_rows, stream.tile_cols),
                  stream.dtype, span=s.sched.rings[0].span),
        ir.Buffer("vectors", "parity", (2, parity.rows, parity.cols), "f32", span=parity.span),
        ir.Buffer("x", "activation", (B, H), "f32", batch_axis=0),
        # Embedding rows arrive as aligned 16-row bf16 blocks (the DMA granule for bf16).
        ir.Buffer("embed_rows", "activation", (B, ir.SUBLANE_TILE["bf16"], H), "bf16",
                  batch_axis=0),
        # The final norm weight, one row (padded to a full f32 tile so its DMA is aligned).
        ir.Buffer("head_norm", "parity", (8, H), "f32"),
        # a tile's input rows of activations: 8-bit codes take more rows than a slot's
        ir.Buffer("stage", "activation", (max(f.row_tiles for f in every), B,
                                          max(f.tile_rows for f in every)),
                  "bf16", batch_axis=1),
        ir.Buffer("acc", "activation", (max(f.col_tiles for f in every), B, stream.tile_cols),
                  "f32", batch_axis=1),
    ]
    for name, (shape, dtype) in sorted(s.graph.activations.items()):
        buffers.append(ir.Buffer(name, "activation", tuple(B if d == -1 else d for d in shape),
                                 dtype, batch_axis=shape.index(-1)))
    for pool in s.pools:
        buffers.append(ir.Buffer(pool.name, "pool", (pool.nbytes // 256, ir.LANES), "bf16",
                                 span=pool.span))
    return buffers

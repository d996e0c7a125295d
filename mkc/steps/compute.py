"""An op of the model graph: one call into the family's lowering, reading what the schedule
brought in (its ring tiles, pooled matrices, routed experts, vectors, state, KV tiles)."""
from __future__ import annotations

from dataclasses import dataclass

from mkc import ir
from mkc.steps.base import Step
from mkc.tags import LayerMatrix, LayerState, LayerVectors


@dataclass(frozen=True)
class Op(Step):
    kind = "op"
    op: str = ""

    def values(self, k: ir.KindSchedule) -> tuple[list[str], list[str]]:
        return k.op_values.get(self.op, ([], []))

    def trace(self, t) -> None:
        k, op, layer, tracer, tb = t.k, self.op, t.layer, t.tracer, t.tb
        w = f"{t.label} {op}"
        tracer.op_event(t.kname, op, layer, w)
        if op in k.matmuls and k.matmuls[op] not in k.pooled:
            r = k.refill
            held = (t.held_refills if r is not None and r.applies(tracer.rows)
                    and self.point <= k.ops.index(r.after_op) else None)
            hold_from = (t.first_tile + ir.held_refills(r.tiles, t.s.stream.ahead).start
                         if held is not None else 0)
            t.tile = tracer.consume_tiles(t.families[k.matmuls[op]], t.tile, w, held, hold_from)
        for fam, view_id in sorted(k.pooled.items()):
            if k.matmuls.get(op) == fam or fam in k.op_reads[op]:
                tb.read(view_id, fam, LayerMatrix(layer, fam), w, tracer.views[view_id].span,
                        tracer.pooled_bytes(view_id, t.kname, fam) if tracer.opts.compute else 0)
        if k.fetch is not None and op == k.fetch.consumer:
            tracer.run_experts(f"{k.fetch.pool}.{k.fetch.view}", layer, w, k.fetch.span)
        if t.vector_families & set(k.op_reads[op]):
            tb.read("vectors", layer % 2, LayerVectors(layer), w, t.s.parity.span)
        for sname in k.op_reads[op]:
            if sname in t.loaded:
                b = t.s.buffer(t.loaded[sname])
                tb.read(b.name, None, t.holds[b.name], w, b.span)
                if sname in k.op_writes[op]:
                    t.holds[b.name] = LayerState(layer, updated=True)
                    tb.write(b.name, None, t.holds[b.name], w, b.span)
        if k.kv is not None and k.kv.at_start and op == k.kv.writer:
            tracer.kv_landed(k, layer, w)
        if k.kv is not None and op == k.kv.op:
            tracer.kv_events(k, layer, w)

    def emit(self, e, indent: str) -> None:
        reads, writes = self.values(e.k)
        target = f"{', '.join(writes)} = " if writes else ""
        e.line(indent, f"{target}lower.{self.op}({', '.join(['c', *reads])})")

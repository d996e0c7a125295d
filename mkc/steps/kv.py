"""KV tiles copied from the layer's start (`kv tiles ... at layer start`): the first `ahead`
tiles' copies start as the layer begins, into tile buffers scoped from there to the op
reading them; the op writing the new rows waits them (`mkc.runtime.kv.write_rows`)."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.steps.base import Step, spec_line


@dataclass(frozen=True)
class KvStart(Step):
    kind = "kv_start"

    def trace(self, t) -> None:
        t.tracer.kv_start(t.k, t.layer, t.where(self.point))

    def emit(self, e, indent: str) -> None:
        e.line(indent, f"c.kv_start()   # {spec_line(e.k.kv.span)}: the first KV tiles, "
                       f"read by {e.k.kv.op}")

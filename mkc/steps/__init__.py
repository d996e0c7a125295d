"""The steps of a layer's program (`mkc.program.layer_program`), one module per statement or
mechanism, each step kind a class that owns its meaning at every stage after the IR:

* ``trace(t)``: the events it adds to the step's trace (`mkc.trace.LayerTrace`), which the
  checks read for hazards and capacity and the step-time model prices;
* ``emit(e, indent)``: the lines it adds to the layer function (`mkc.codegen.layers`);
* ``values(k)``: the register values it reads and defines, which emitted scopes pass on.

Dispatch is by type (``step.trace(t)``), as Pallas registers a lowering rule per primitive:
a new step kind is a new class here, not a branch in each stage.

| module | steps | the statements' syntax (`mkc/lang/statements/`) |
| --- | --- | --- |
| `copies` | `Start`, `Wait`, `Drain` | `copies` (state loads and stores, their waits) |
| `scopes` | `ScopeOpen`, `ScopeClose` | `scoped` |
| `vectors` | `Vectors` | `parity` |
| `views` | `Prefetch`, `Fetch`, `PoolWait`, `ViewClose` | `pool`, `experts` |
| `ring` | `Refill` | `refill` |
| `kv` | `KvStart` | `kv` (`at layer start`) |
| `collectives` | `AllReduce`, `AllGather`, `Exchange`, `Overlap*` (the parts) | `collectives` |
| `compute` | `Op` | none: the model graph's ops (ring tiles, pooled and expert reads, KV tiles) |
"""
from mkc.steps.base import Step, spec_line
from mkc.steps.collectives import (AllGather, AllReduce, Exchange, OverlapAdvance, OverlapFinish,
                                   OverlapPart, OverlapStart)
from mkc.steps.compute import Op
from mkc.steps.copies import Drain, Start, Wait
from mkc.steps.kv import KvStart
from mkc.steps.ring import Refill
from mkc.steps.scopes import ScopeClose, ScopeOpen
from mkc.steps.vectors import Vectors
from mkc.steps.views import Fetch, PoolWait, Prefetch, ViewClose

__all__ = ["Step", "spec_line", "AllGather", "AllReduce", "Exchange", "OverlapAdvance",
           "OverlapFinish", "OverlapPart", "OverlapStart", "Op", "Drain", "Start",
           "Wait", "ScopeClose", "ScopeOpen", "Vectors", "Fetch", "PoolWait", "Prefetch",
           "ViewClose", "Refill", "KvStart"]

"""Pass `ir`: the resolved parts assembled into the schedule IR, with what later stages need
from the family copied in (no stage after resolve goes back to the family registry)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import fields, replace

from mkc import ir
from mkc.resolve.state import ResolveState

# A state field named as a ScheduleIR field holds the same thing and is copied as it is (so a
# new statement's pass reaches the IR by naming its state field after its IR field); these
# share a name but not a shape, and are converted below.
_CONVERTED = {"dims", "family", "shards", "topology"}
_COPIED = tuple(sorted({f.name for f in fields(ResolveState)}
                       & {f.name for f in fields(ir.ScheduleIR)} - _CONVERTED))


def ir_dims(dims) -> dict:
    """The model's dims as the IR holds them: every field, but a field marked `when_set` (its
    metadata; DeepSeek-V3's `weight_block_size`) left out at its default, so the models without
    it keep the IR, the scratch measures (`checks.capacity.scratch_key`) and the modules they
    had before it was added."""
    marked = {f.name: f.default for f in fields(dims) if f.metadata.get("when_set")}
    return {k: v for k, v in dims.__dict__.items() if k not in marked or v != marked[k]} | {
        "layer_kinds": list(dims.layer_kinds)}


def resolve_ir(s: ResolveState) -> ResolveState:
    sched, dims, family, graph, topo = s.sched, s.dims, s.family, s.graph, s.topology
    b_lo, b_hi = s.batch
    config = s.model_config
    return replace(s, schedule_ir=ir.ScheduleIR(
        name=sched.name.text, source=sched.source_file, model=dims.name,
        family=dims.family, dims=ir_dims(dims),
        chip=topo.chip.name, topology=topo.spec, ranks=topo.num_cores,
        cores_per_chip=topo.chip.cores_per_chip, batch_min=b_lo, batch_max=b_hi,
        weight_formats=dict(graph.formats),
        family_package=family.package, dims_class=family.dims_import, final_logits=family.final_logits,
        compiler_scratch=family.measured_scratch(),
        vmem_inputs=tuple(family.vmem_inputs(dims, b_hi)),
        vmem_capacity=topo.chip.vmem_bytes, hbm_per_core=topo.chip.hbm_bytes,
        layer_kinds=list(dims.layer_kinds),
        globals={n: (t.shape, t.dtype) for n, t in graph.globals.items()},
        per_rank=dict(graph.per_rank),
        shards={c: (w, st) for c, w, st in s.shards.rules},
        experts={n: (t.shape, t.dtype) for n, t in graph.experts.items()},
        kind_experts={k: {n: (t.shape, t.dtype) for n, t in ts.items()}
                      for k, ts in graph.kind_experts.items()},
        kind_weight_formats={k: dict(f) for k, f in graph.kind_formats.items()},
        top_k=graph.top_k, experts_total=graph.experts_total,
        setting_spans={k: v.span for k, v in sched.settings.items()},
        config_digest=hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        matrix_facts={f"{prefix}.{t.name}": t.mxu for prefix, tensors in
                      [(k, kd.tensors) for k, kd in graph.kinds.items()]
                      + [(f"{k}.expert", graph.experts_of(k)) for k, kd in graph.kinds.items()
                         if any(o.runs_experts for o in kd.ops)] + [("tail", graph.globals)]
                      for t in tensors.values() if t.mxu is not None},
        **{name: getattr(s, name) for name in _COPIED}))

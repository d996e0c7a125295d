"""Pass `ir`: the resolved parts assembled into the schedule IR, with what later stages need
from the family copied in (no stage after resolve goes back to the family registry)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from mkc import ir
from mkc.resolve.state import ResolveState


def resolve_ir(s: ResolveState) -> ResolveState:
    sched, dims, family, graph, topo = s.sched, s.dims, s.family, s.graph, s.topology
    b_lo, b_hi = s.batch
    config = s.model_config
    return replace(s, schedule_ir=ir.ScheduleIR(
        name=sched.name.text, source=sched.source_file, model=dims.name,
        family=dims.family, dims=dims.__dict__ | {"layer_kinds": list(dims.layer_kinds)},
        model_config=config,
        chip=topo.chip.name, topology=topo.spec, mesh_axis=s.mesh_axis, ranks=topo.num_cores,
        cores_per_chip=topo.chip.cores_per_chip, batch_min=b_lo, batch_max=b_hi,
        verify_rows=s.verify_rows, verify_sequences=s.verify_sequences,
        weight_formats=dict(graph.formats),
        family_package=family.package, dims_class=family.dims_import,
        compiler_scratch=family.compiler_scratch,
        vmem_inputs=tuple(family.vmem_inputs(dims, b_hi)),
        context=s.context, vmem_limit=s.vmem_limit, vmem_reserve=s.vmem_reserve,
        vmem_capacity=topo.chip.vmem_bytes, hbm_per_core=topo.chip.hbm_bytes,
        layer_kinds=list(dims.layer_kinds), kinds=s.kinds, buffers=s.buffers, stream=s.stream,
        parity=s.parity,
        globals={n: (t.shape, t.dtype) for n, t in graph.globals.items()},
        hbm_bytes_per_rank=s.hbm_bytes_per_rank, per_rank=dict(graph.per_rank), pools=s.pools,
        shards={c: (w, st) for c, w, st in s.shards.rules},
        embed_reduce=s.embed_reduce,
        experts={n: (t.shape, t.dtype) for n, t in graph.experts.items()},
        top_k=graph.top_k, experts_total=graph.experts_total,
        setting_spans={k: v.span for k, v in sched.settings.items()},
        config_digest=hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        matrix_facts={f"{prefix}.{t.name}": t.mxu for prefix, tensors in
                      [(k, kd.tensors) for k, kd in graph.kinds.items()] + [("expert", graph.experts)]
                      for t in tensors.values() if t.mxu is not None}))

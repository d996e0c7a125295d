"""Pass `hbm`: the HBM bytes one rank holds, by class (checked against the chip's HBM by
`mkc.checks.capacity.check_hbm`)."""
from __future__ import annotations

from dataclasses import replace

from mkc.resolve.pools import expert_slot_bytes
from mkc.resolve.state import ResolveState


def resolve_hbm(s: ResolveState) -> ResolveState:
    """Weights padded as packed (ring slots, pool forms, routed experts' slot images); a verify
    step's output adds a recurrent state per row."""
    graph, stream, B, context = s.graph, s.stream, s.batch[1], s.context
    verify_rows = s.verify_rows * s.verify_sequences[1]
    state = cache = row_state = 0
    for kname in graph.layer_kinds:
        for t in graph.kinds[kname].states():
            if t.role == "state":
                state += B * t.nbytes
                row_state += verify_rows * t.nbytes
            else:       # one slot per token of the context, or of the window's KV ring
                kv = s.kinds[kname].kv if kname in s.kinds else None
                cache += B * (kv.cache_tokens(context) if kv else context) * t.nbytes
    out = {"streamed weights": stream.total_tiles * stream.tile_rows * stream.tile_cols * 2}
    pooled = sum(m.nbytes * graph.layer_kinds.count(kname) for p in s.pools for v in p.views
                 for kname, ms in v.matrices.items() if kname in graph.kinds for m in ms)
    if pooled:
        out["pooled weights"] = pooled
    if graph.experts:
        consumers = [k for k in set(graph.layer_kinds)
                     if any(o.runs_experts for o in graph.kinds[k].ops)]
        out["routed experts"] = sum(graph.layer_kinds.count(k) * graph.per_rank["local_experts"]
                                    * expert_slot_bytes(graph, k) for k in consumers)
    out |= {"embedding": graph.globals["embed"].nbytes,
            "vectors": len(graph.layer_kinds) * s.parity.rows * s.parity.cols * 4,
            "recurrent state": state, "kv cache": cache}
    return replace(s, hbm_bytes_per_rank=out | ({"verify states": row_state} if row_state else {}))

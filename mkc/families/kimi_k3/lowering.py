"""Constants the K3 module template prints beyond the shared geometry: the pool layout and the
sharding facts its compute bodies index by."""
from __future__ import annotations

from mkc import ir


def template_facts(s: ir.ScheduleIR) -> dict:
    """Pool layout and sharding facts the K3 template prints as constants."""
    pool = s.pools[0]
    weights = next(v for v in pool.views if v.slots == 0)
    experts = next(v for v in pool.views if v.slots > 0)
    pooled = {kind: {m.name: [m.offset // 256, m.rows, m.cols, i] for i, m in enumerate(mats)}
              for kind, mats in sorted(weights.matrices.items())}
    dtypes = {kind: {m.name: m.dtype for m in mats} for kind, mats in weights.matrices.items()}
    dtypes["expert"] = {m.name: m.dtype for m in experts.matrices["expert"]}
    return {
        "pool": pool.name, "pool_rows": pool.nbytes // 256,
        "pooled": pooled, "pool_dtypes": dtypes,
        "pool_sems": max(len(mats) for mats in weights.matrices.values()),
        "expert_slots": experts.slots, "expert_slot_rows": experts.slot_bytes // 256,
        "expert_mats": {m.name: [m.offset // 256, m.rows, m.cols] for m in experts.matrices["expert"]},
        "worst_experts": min(s.top_k * s.batch_max, s.per_rank["local_experts"]),
        "sources": next(b.shape[0] for b in s.buffers if b.name == "blocks"),
        "expert_tp": s.per_rank["expert_tp"], "host_cores": s.per_rank["host_cores"],
        "router_split": s.per_rank["router_split"],
        "pooled_inputs": [f"pool__{kind}__{name}" for kind, mats in pooled.items() for name in mats],
        "expert_inputs": [f"expert__{m.name}" for m in experts.matrices["expert"]],
        "state_names": ["kda__conv", "kda__recurrent", "mla__latent"],
    }

"""A bandwidth model of one decode step: the HBM bytes a rank moves and the time that takes.

A decode step is bound by HBM bandwidth, so bytes / bandwidth is its floor; real steps add
compute, collective latency and pipeline bubbles, which only a TPU run can measure.
"""
from __future__ import annotations

from mkc import ir


def hbm_traffic(s: ir.ScheduleIR, batch: int, tokens_in_cache: int,
                sequences: int | None = None, routed_rows: int | None = None) -> dict[str, int]:
    """Bytes one rank reads or writes in HBM per step of `batch` rows, by class. A verify step
    runs its rows as fewer `sequences`: it reads their caches and states, and writes a state
    per row. Routed experts as `routed_rows` rows routing independently pick them (default
    every row: `mkc.perf.run.ROUTINGS`)."""
    st = s.stream
    sequences = sequences or batch
    state = sum(_prod(shape) * ir.DTYPE_BYTES[dtype]
                for kname in s.layer_kinds for shape, dtype in s.kinds[kname].states.values())
    kv = 0
    for kname in s.layer_kinds:
        k = s.kinds[kname]
        if k.kv:
            caches = [b for b in s.buffers if b.cls == "kv" and b.scope and b.scope[0] == kname]
            # a window's KV ring holds at most its slots, whatever the context
            tiles = -(-min(tokens_in_cache, k.kv.cache_tokens(tokens_in_cache)) // k.kv.tokens)
            kv += sum(sequences * tiles * k.kv.tokens * b.shape[-1] * ir.DTYPE_BYTES[b.dtype]
                      for b in caches)
    traffic = {"weights": st.streamed_bytes}
    pooled = sum(m.nbytes for kname in s.layer_kinds for p in s.pools for v in p.views
                 for m in v.matrices.get(kname, []))
    if pooled:
        traffic["pooled weights"] = pooled
    if s.experts:
        traffic["routed experts (uniform routing)"] = round(
            expected_local_experts(s, routed_rows or batch)
            * sum(_prod(shape) * ir.DTYPE_BYTES[dtype] for k in s.layer_kinds
                  if s.kinds[k].fetch is not None for shape, dtype in s.experts_of(k).values()))
    return traffic | {
        "vectors": len(s.layer_kinds) * s.parity.rows * s.parity.cols * 4,
        "state (load + store)": (sequences + batch) * state,
        "kv cache": kv,
    }


def expected_local_experts(s: ir.ScheduleIR, batch: int) -> float:
    """Distinct experts of one rank's group that `batch` rows pick per MoE layer, if routing
    were uniform: each of the group's experts is picked by a row with probability top_k / E."""
    experts = s.experts_total
    local = s.per_rank["local_experts"]
    return local * (1 - (1 - s.top_k / experts) ** batch)


def step_floor_seconds(s: ir.ScheduleIR, hbm_bytes_per_s: float, batch: int,
                       tokens_in_cache: int, sequences: int | None = None,
                       routed_rows: int | None = None) -> float:
    return sum(hbm_traffic(s, batch, tokens_in_cache, sequences, routed_rows).values()) / hbm_bytes_per_s


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

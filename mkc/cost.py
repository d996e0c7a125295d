"""A bandwidth model of one decode step: the HBM bytes a rank moves and the time that takes.

A decode step is bound by HBM bandwidth, so bytes / bandwidth is its floor; real steps add
compute, collective latency and pipeline bubbles, which only a TPU run can measure.
"""
from __future__ import annotations

from mkc import ir


def hbm_traffic(s: ir.ScheduleIR, batch: int, tokens_in_cache: int) -> dict[str, int]:
    """Bytes one rank reads or writes in HBM per step, by class."""
    st = s.stream
    state = sum(batch * _prod(shape) * ir.DTYPE_BYTES[dtype]
                for kname in s.layer_kinds for shape, dtype in s.kinds[kname].states.values())
    kv = 0
    for kname in s.layer_kinds:
        k = s.kinds[kname]
        if k.kv:
            width = next(b.shape[-1] for b in s.buffers if b.cls == "kv" and b.scope
                         and b.scope[0] == kname)
            tiles = -(-tokens_in_cache // k.kv.tokens)
            kv += 2 * batch * tiles * k.kv.tokens * width * ir.DTYPE_BYTES["bf16"]
    return {
        "weights": st.streamed_bytes,
        "vectors": len(s.layer_kinds) * s.parity.rows * s.parity.cols * 4,
        "state (load + store)": 2 * state,
        "kv cache": kv,
    }


def step_floor_seconds(s: ir.ScheduleIR, hbm_bytes_per_s: float, batch: int,
                       tokens_in_cache: int) -> float:
    return sum(hbm_traffic(s, batch, tokens_in_cache).values()) / hbm_bytes_per_s


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

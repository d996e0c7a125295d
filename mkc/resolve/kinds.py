"""Pass `kinds`: each layer kind's schedule, assembled from the parts earlier passes resolved
(each the one writer of its part): the schedule its phase block writes (`phases`), its KV
ring (`kv_ring`), its collectives (`collectives`), its copies into pool views (`views`) and
its held-back ring refills (`refills`)."""
from __future__ import annotations

from dataclasses import replace

from mkc.resolve.state import ResolveState


def resolve_kinds(s: ResolveState) -> ResolveState:
    kinds = {}
    for kname, ks in s.phase_schedules.items():
        collectives, copies = s.collectives[kname], s.view_copies[kname]
        kinds[kname] = replace(ks, kv=s.kv_rings.get(kname, ks.kv),
                               allreduces=collectives.allreduces,
                               allgathers=collectives.allgathers,
                               exchanges=collectives.exchanges,
                               fetch=copies.fetch, prefetch=copies.prefetch,
                               refill=s.refills[kname])
    return replace(s, kinds=kinds)

"""The step sequence of one layer of a kind: the single ordering the trace and codegen share.

At a program point: (at point 0) the layer's vectors are waited, the next layer's issued and
the previous layer's draining copies waited; then waits of copies started earlier; then starts
(and waits of copies started at this same point) of buffers not in a scope opening here; then
scopes whose range ends here close, innermost first; then scopes starting here open,
outermost first; then the starts (and same-point waits) into the buffers they hold. A scope
covers points first..last+1, and resolve only accepts scopes that nest or are disjoint, so the
opens and closes always nest (each is one `pl.run_scoped` in the generated code).
"""
from __future__ import annotations

import dataclasses

from mkc import ir
from mkc.steps import (AllGather, AllReduce, Drain, Exchange, Fetch, KvStart, Op,
                       OverlapAdvance, OverlapFinish, OverlapStart, PoolWait, Prefetch, Refill,
                       ScopeClose, ScopeOpen, Start, Step, Vectors, ViewClose, Wait)


def _view_readers(k: ir.KindSchedule) -> tuple[dict[int, list[str]], dict[str, int]]:
    """({op index: the pooled matrices first read there}, {view: the last op reading it}): a
    pooled matrix is waited before the first op that reads it; a view closes after the last op
    reading anything in it (for routed experts: the op that runs them)."""
    first_reader: dict[int, list[str]] = {}
    last_reader: dict[str, int] = {}
    for fam, view in sorted(k.pooled.items()):
        readers = [i for i, op in enumerate(k.ops)
                   if k.matmuls.get(op) == fam or fam in k.op_reads[op]]
        first_reader.setdefault(readers[0], []).append(fam)
        last_reader[view] = max(last_reader.get(view, -1), readers[-1])
    if k.fetch is not None:
        last_reader[f"{k.fetch.pool}.{k.fetch.view}"] = k.ops.index(k.fetch.consumer)
    return first_reader, last_reader


def _scopes(s: ir.ScheduleIR, kind: str) -> dict[tuple, tuple[ir.Buffer, ...]]:
    """{scope: its buffers} of the ranges the layer's program opens, outer first (by first
    op, then the longer range): `scoped` state buffers, and KV tiles copied from the layer's
    start (otherwise the op reading KV tiles scopes them itself, `mkc.runtime.kv.stream`)."""
    k = s.kinds[kind]
    early_kv = set(k.kv.tile_buffers) if k.kv is not None and k.kv.at_start else set()
    mine = [b for b in s.buffers if b.scope and b.scope[0] == kind
            and (b.cls == "state" or b.name in early_kv)]
    return {sc: tuple(b for b in mine if b.scope == sc)
            for sc in sorted({b.scope for b in mine}, key=lambda sc: (sc[1], -sc[2]))}


def layer_program(s: ir.ScheduleIR, kind: str) -> list[Step]:
    k = s.kinds[kind]
    scope_buffers = _scopes(s, kind)
    scopes = list(scope_buffers)
    early_kv = k.kv is not None and k.kv.at_start
    steps: list[Step] = []

    def transfers_at(p: int, buffers: set[str], inside: bool) -> None:
        mine = [t for t in k.transfers if t.start == p and (t.buffer in buffers) == inside]
        steps.extend(Start(p, transfer=t) for t in mine)
        steps.extend(Wait(p, transfer=t) for t in mine if p in t.waits)

    def point(p: int) -> None:
        if p == 0:
            steps.append(Vectors(p))
            # copies of the previous layer of this kind that drain here
            steps.extend(Drain(p, transfer=t) for t in k.transfers for _ in range(t.drain))
        steps.extend(Wait(p, transfer=t) for t in k.transfers if t.start < p and p in t.waits)
        opening = [(i, sc) for i, sc in enumerate(scopes) if sc[1] == p]
        opening_buffers = {b.name for _, sc in opening for b in scope_buffers[sc]}
        transfers_at(p, opening_buffers, inside=False)
        steps.extend(ScopeClose(p, buffers=scope_buffers[sc], scope=i)
                     for i, sc in reversed(list(enumerate(scopes))) if sc[2] + 1 == p)
        steps.extend(ScopeOpen(p, buffers=scope_buffers[sc], scope=i) for i, sc in opening)
        transfers_at(p, opening_buffers, inside=True)
        if p == 0 and early_kv:
            steps.append(KvStart(p))

    first_reader, last_reader = _view_readers(k)

    def copies(p: int, which: tuple) -> None:
        for step, vc in which:
            if vc is not None and vc.start == p:
                steps.append(step(p, view=f"{vc.pool}.{vc.view}"))

    prefetch, fetch = ((Prefetch, k.prefetch),), ((Fetch, k.fetch),)
    after = {a.after_op: AllReduce(0, op=a.after_op, entry=a) for a in k.allreduces}
    gathers = {g.after_op: AllGather(0, op=g.after_op, entry=g) for g in k.allgathers}
    gathers |= {e.after_op: Exchange(0, op=e.after_op, entry=e) for e in k.exchanges}
    # An overlapped collective starts after its op, lands a stage and starts the next after
    # each of the ops that follow while it has stages left, and finishes before its first
    # reader's point (resolve checks the window).
    in_flight: list[tuple[AllReduce | AllGather, int]] = []     # (collective, its reader)
    advances: dict[AllReduce | AllGather, int] = {}

    for i, op in enumerate(k.ops):
        point(i)
        copies(i, prefetch + fetch if i == 0 else fetch)
        # copies issued at this point start before the wait for a collective's last stage
        for c, j in [f for f in in_flight if f[1] == i]:
            steps.append(OverlapFinish(i, collective=c))
            in_flight.remove((c, j))
        steps.extend(PoolWait(i, family=fam, view=k.pooled[fam])
                     for fam in first_reader.get(i, []))
        steps.append(Op(i, op=op))
        for c, _ in in_flight:
            if advances[c]:
                advances[c] -= 1
                steps.append(OverlapAdvance(i, collective=c))
        steps.extend(ViewClose(i, view=v) for v, last in sorted(last_reader.items()) if last == i)
        # A prefetch from the next point starts before this op's collectives: it needs no
        # value, only its view free (no collective reads a pool), and HBM idles under them;
        # so do the ring refills held back to here.
        copies(i + 1, prefetch)
        steps.extend(Refill(i + 1) for r in (k.refill,) if r is not None and r.after_op == op)
        for table in (after, gathers):
            if op in table:
                step = dataclasses.replace(table[op], point=i)
                if getattr(step.entry, "overlap", False):
                    steps.append(OverlapStart(i, collective=step))
                    in_flight.append((step, k.ops.index(step.entry.finish_before)))
                    advances[step] = step.most_stages() - 1
                else:
                    steps.append(step)
    point(len(k.ops))
    copies(len(k.ops), fetch)
    return steps

"""The step sequence of one layer of a kind: the single ordering the trace and codegen share.

At a program point: scopes open; (at point 0) the layer's vectors are waited, the next
layer's issued and the previous layer's draining copies waited; then waits of copies started
earlier, starts, waits of copies started at this same point; then scopes whose range ends
here close. A scope covers points first..last+1.
"""
from __future__ import annotations

from dataclasses import dataclass

from mkc import ir


@dataclass(frozen=True)
class Step:
    kind: str                              # scope_open | scope_close | vectors | drain | start |
                                           # wait | op | allreduce
    point: int
    op: str = ""
    transfer: ir.Transfer | None = None
    allreduce: ir.AllReduce | None = None
    buffers: tuple[ir.Buffer, ...] = ()


def layer_program(s: ir.ScheduleIR, kind: str) -> list[Step]:
    k = s.kinds[kind]
    scopes = sorted({b.scope for b in s.buffers if b.scope and b.scope[0] == kind
                     and b.cls == "state"}, key=lambda sc: (sc[1], -sc[2]))

    def scoped(sc) -> tuple[ir.Buffer, ...]:
        return tuple(b for b in s.buffers if b.scope == sc and b.cls == "state")

    steps: list[Step] = []

    def point(p: int) -> None:
        steps.extend(Step("scope_open", p, buffers=scoped(sc)) for sc in scopes if sc[1] == p)
        if p == 0:
            steps.append(Step("vectors", p))
            # copies of the previous layer of this kind that drain here
            steps.extend(Step("drain", p, transfer=t) for t in k.transfers
                         for _ in range(t.drain))
        steps.extend(Step("wait", p, transfer=t) for t in k.transfers
                     if t.start < p and p in t.waits)
        steps.extend(Step("start", p, transfer=t) for t in k.transfers if t.start == p)
        steps.extend(Step("wait", p, transfer=t) for t in k.transfers
                     if t.start == p and p in t.waits)
        steps.extend(Step("scope_close", p, buffers=scoped(sc)) for sc in reversed(scopes)
                     if sc[2] + 1 == p)

    reduce_after = {a.after_op: a for a in k.allreduces}
    for i, op in enumerate(k.ops):
        point(i)
        steps.append(Step("op", i, op=op))
        if op in reduce_after:
            steps.append(Step("allreduce", i, op=op, allreduce=reduce_after[op]))
    point(len(k.ops))
    return steps

"""The resolve state verified between passes (as MLIR and TVM verify IR between passes).

Each invariant holds from the pass that establishes it on; after every pass the driver checks
those established so far, so a pass that breaks what an earlier one built is caught where it
happens. A violation is a compiler bug, not a spec's: `ResolveInvariantError` names the pass
after which it broke and what is wrong. Each check walks the spec's and the model graph's
structure (layer kinds, ops, buffers, stream entries, views), never the context's tokens or the
slice's ranks, so its cost does not grow with either.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from mkc import ir
from mkc.resolve.state import ResolveState


class ResolveInvariantError(RuntimeError):
    """A resolve pass produced a state that breaks an invariant: a bug in mkc."""


@dataclass(frozen=True)
class Invariant:
    established_by: str                          # the pass after which it holds
    what: str                                    # what holds, for the error
    problems: Callable[[ResolveState], Iterator[str]]   # what is wrong, if anything


def _model(s: ResolveState) -> Iterator[str]:
    for name in ("model_config", "dims", "family"):
        if getattr(s, name) is None:
            yield f"{name} is not set"


def _target(s: ResolveState) -> Iterator[str]:
    if s.topology is None or not s.mesh_axis:
        yield "the topology or the mesh axis is not set"


def _batch(s: ResolveState) -> Iterator[str]:
    if s.batch is None or not 1 <= s.batch[0] <= s.batch[1]:
        yield f"batch range {s.batch} is not 1 <= fewest <= most"
    if s.context is None or s.context < 1:
        yield f"context {s.context} is not positive"


def _graph(s: ResolveState) -> Iterator[str]:
    g = s.graph
    if g is None:
        yield "the graph is not set"
        return
    if not g.layer_kinds:
        yield "the graph runs no layer"
    for kname in sorted(set(g.layer_kinds) - set(g.kinds)):
        yield f"layer kind {kname} runs but the graph does not define it"
    for kname, kind in g.kinds.items():
        for op in kind.ops:
            if op.matmul and op.matmul not in kind.tensors:
                yield f"{kname}.{op.name} multiplies by {op.matmul}, which {kname} does not hold"


def _layer_kinds(s: ResolveState) -> Iterator[str]:
    for kname in sorted(set(s.graph.layer_kinds) - set(s.phases)):
        yield f"layer kind {kname} has no phase"
    for kname in sorted(set(s.phases) - set(s.graph.kinds)):
        yield f"phase {kname} names no layer kind of the graph"


def _views(s: ResolveState) -> set[str]:
    return {f"{p.name}.{v.name}" for p in s.pools for v in p.views}


def _pools(s: ResolveState) -> Iterator[str]:
    views = _views(s)
    for kname, held in s.pooled.items():
        if kname not in s.graph.kinds:
            yield f"pooled matrices of {kname}, which is no layer kind"
            continue
        for family, view in held.items():
            if view not in views:
                yield f"{kname}.{family} is held in {view}, which is no pool view"
            if family not in s.graph.kinds[kname].tensors:
                yield f"{kname}.{family} is held in {view} but is no matrix of {kname}"


def _matmuls(s: ResolveState) -> dict[str, dict[str, str]]:
    """Layer kind -> op -> the matrix family it multiplies by: the kind schedules' once they
    exist (later passes rewrite them), the graph's before."""
    if s.kinds is not None:
        return {k: dict(ks.matmuls) for k, ks in s.kinds.items()}
    return {k: {o.name: o.matmul for o in s.graph.kinds[k].ops if o.matmul}
            for k in set(s.graph.layer_kinds)}


def _stream(s: ResolveState) -> Iterator[str]:
    """Every matmul of a layer that runs reads its matrix from a ring entry or a pool entry."""
    st = s.stream
    if st is None:
        yield "the stream is not set"
        return
    for kname, families in st.families.items():
        for f in families:
            if f.name not in s.graph.kinds[kname].tensors:
                yield f"the ring streams {kname}.{f.name}, which is no matrix of {kname}"
    for kname, ops in sorted(_matmuls(s).items()):
        streamed = {f.name for f in st.families.get(kname, ())}
        pooled = s.pooled.get(kname, {})
        for op, family in ops.items():
            if family not in streamed and family not in pooled:
                yield f"{kname}.{op} multiplies by {family}, which has no stream entry (ring or pool)"
    if len(st.layer_tile_offset) != len(s.graph.layer_kinds):
        yield (f"the stream has {len(st.layer_tile_offset)} layer tile offsets for "
               f"{len(s.graph.layer_kinds)} layers")
    if st.total_tiles < 1 or not st.tail:
        yield "the stream has no tiles or no tail (lm_head)"


def _parity(s: ResolveState) -> Iterator[str]:
    for kname in sorted(set(s.parity.layout) - set(s.graph.kinds)):
        yield f"the vector block lays out {kname}, which is no layer kind"


def _point_in(what: str, point: int, n_ops: int) -> Iterator[str]:
    if not 0 <= point <= n_ops:
        yield f"{what} at program point {point}, outside 0..{n_ops}"


def _phase_schedules(s: ResolveState) -> Iterator[str]:
    yield from _schedules(s, s.phase_schedules)


def _kinds(s: ResolveState) -> Iterator[str]:
    yield from _schedules(s, s.kinds)


def _schedules(s: ResolveState, schedules: dict[str, ir.KindSchedule] | None) -> Iterator[str]:
    """Each layer kind's schedule (as its phase writes it, or assembled): its ops the graph's,
    its steps at program points of them, naming ops it has and buffers and views that exist
    (once they do)."""
    if schedules is None:
        yield "the layer kinds' schedules are not set"
        return
    for kname in sorted(set(s.graph.layer_kinds) - set(schedules)):
        yield f"layer kind {kname} runs but has no schedule"
    buffers = None if s.buffers is None else {b.name for b in s.buffers}
    views = _views(s)
    for kname, k in schedules.items():
        graph_ops = s.graph.kinds[kname].op_names() if kname in s.graph.kinds else None
        if list(k.ops) != list(graph_ops or ()):
            yield f"{kname}'s ops {k.ops} are not its graph's {graph_ops}"
        ops, n = set(k.ops), len(k.ops)
        for op in k.matmuls:
            if op not in ops:
                yield f"{kname} has a matmul for {op}, which is no op of it"
        for t in k.transfers:
            yield from _point_in(f"{kname}'s {t.direction} of {t.state} starts", t.start, n)
            for w in t.waits:
                yield from _point_in(f"{kname}'s {t.direction} of {t.state} waits", w, n)
        if k.kv is not None and k.kv.op not in ops:
            yield f"{kname}'s KV tiles are read by {k.kv.op}, which is no op of it"
        for c in (*k.allreduces, *k.allgathers, *k.exchanges):
            if c.after_op not in ops:
                yield f"{kname} has a collective after {c.after_op}, which is no op of it"
        for family, view in k.pooled.items():
            if view not in views:
                yield f"{kname}.{family} is held in {view}, which is no pool view"
        for copy in (k.prefetch, k.fetch):
            if copy is None:
                continue
            if f"{copy.pool}.{copy.view}" not in views:
                yield f"{kname} copies into {copy.pool}.{copy.view}, which is no pool view"
            yield from _point_in(f"{kname}'s copy into {copy.pool}.{copy.view}", copy.start, n)
            if copy.consumer and copy.consumer not in ops:
                yield f"{kname}'s experts are read by {copy.consumer}, which is no op of it"
        if buffers is not None:
            named = [t.buffer for t in k.transfers]
            if k.kv is not None:
                named += [*k.kv.tile_buffers, *([k.kv.rows_buffer] if k.kv.rows_buffer else [])]
            for name in named:
                if name not in buffers:
                    yield f"{kname} uses buffer {name}, which is not among the kernel's buffers"


def _buffers(s: ResolveState) -> Iterator[str]:
    names = [b.name for b in s.buffers]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            yield f"buffer {name} is declared twice"
        seen.add(name)
    if s.stream.ring not in seen:
        yield f"the ring's buffer {s.stream.ring} is not among the kernel's buffers"
    for b in s.buffers:
        if b.scope is None:
            continue
        kname, first, last = b.scope
        if kname not in s.kinds:
            yield f"buffer {b.name} is scoped in {kname}, which has no schedule"
            continue
        n = len(s.kinds[kname].ops)
        yield from _point_in(f"the scope of {b.name} opens", first, n)
        yield from _point_in(f"the scope of {b.name} closes", last, n)


def _assembled(s: ResolveState) -> Iterator[str]:
    x = s.schedule_ir
    if x is None:
        yield "the schedule IR is not set"
        return
    if list(x.layer_kinds) != list(s.graph.layer_kinds):
        yield "the IR's layer kinds are not the graph's"
    if x.kinds is not s.kinds or x.buffers is not s.buffers or x.stream is not s.stream:
        yield "the IR's kinds, buffers or stream are not the state's"


# In the order of the passes that establish them (`driver.PASSES`).
INVARIANTS: tuple[Invariant, ...] = (
    Invariant("model", "the model is read", _model),
    Invariant("target", "the slice and mesh are set", _target),
    Invariant("batch", "the batch range and context are sound", _batch),
    Invariant("graph", "the graph defines every layer kind it runs and every matrix its ops "
                       "multiply by", _graph),
    Invariant("layer_kinds", "every layer kind that runs has a phase, and every phase a kind",
              _layer_kinds),
    Invariant("pools", "pooled matrices name layer kinds, their matrices and pool views", _pools),
    Invariant("stream", "every matmul has its stream entry (ring or pool)", _stream),
    Invariant("parity", "the vector block lays out layer kinds", _parity),
    Invariant("phases", "every layer kind's schedule as its phase writes it names its ops, "
                         "buffers and views, at program points in range", _phase_schedules),
    Invariant("kinds", "every layer kind's schedule names its ops, buffers and views, at "
                        "program points in range", _kinds),
    Invariant("buffers", "buffer names are unique, and scopes and the ring name real ones",
              _buffers),
    Invariant("ir", "the schedule IR is the state assembled", _assembled),
)


def verify_state(s: ResolveState, after: str) -> None:
    """Check every invariant established by the passes run so far (`s.passes`), after pass
    `after`; ResolveInvariantError on the first that does not hold."""
    for inv in INVARIANTS:
        if inv.established_by not in s.passes:
            continue
        problems = list(inv.problems(s))
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ResolveInvariantError(
                f"mkc internal error after resolve pass {after!r}: {inv.what} (established by "
                f"pass {inv.established_by!r}) no longer holds: {problems[0]}{more}. This is a "
                "bug in mkc, not in the spec")

"""`mkc tune SPEC -o OUT`: search a schedule's geometry for a shorter modelled step.

The knobs are the numbers and choices of the spec that move memory, not what is computed:
the weight ring's slots, its tile bound and how far the stream runs ahead; each phase's KV tile
stream (slots, tokens per tile, ahead); each pool's expert slots; which of a kind's matrices a
pool's weight view holds whole and which stream through the ring; where each `prefetch next`
starts and each `refill` releases; each all-reduce's algorithm (direct, or two_level within a
chip or a host where the topology has more than one; one-shot or `scatter`, at every kernel
width or from the widest kernel's rows; run at once or `overlap`ped), and whether each
all-gather overlaps. Knobs are found in the spec's AST and each is edited in place, as the few
tokens of its statement that change: layout and every other token stay.

The objective is the mean of the modelled step times at the spec's smallest and largest batch
(its `batch A to B`; one batch if A == B), at its context. Every candidate is parsed, resolved
and checked like `mkc check` before it is timed; one that fails a check is dropped (and
counted). The search is coordinate descent: each pass tries every knob's neighbours from the
current best and keeps the best improvement, until a pass improves nothing or the evaluation
budget is spent. Then one coupled move is tried, which no single knob finds since its first
half alone is slower: a matrix moved out of a pool view (the pool shrinks) with the VMEM freed
spent on ring slots; if it improves, the descent resumes from it. A move counts as an
improvement only where it shortens the objective by MIN_GAIN (0.1 %) or more; at the end each
change is reverted on its own (the budget holds an evaluation back for each), and one that
gains less than that is dropped (a later change can make an earlier one worth nothing). Each
evaluation costs one check plus one simulation per batch (measured on a busy 2-core machine:
1-3 s for the MINI Qwen, 10-15 s for Kimi K3), more where a candidate's op bodies have no
measure and are compiled with libtpu first; the same text is never evaluated twice. The first
candidate's time is logged as the estimate of the rest.

A candidate must also leave `min_headroom` (1 MiB unless told) of VMEM under the budget in
every kernel the VMEM verdict judges (`capacity.kernels`: the decode step at each bounding
batch and every verify step); one that leaves less is refused, and the table prints the
headroom of the spec written in each.
A spec's own `expect` lines are checks like any other: a candidate that breaks one is refused.
The spec written is the best candidate's text with, for each statement a change touched, the
comments it owns that state numbers (they quote the old value or its modelled figures)
replaced by one note of the change (`mkc.perf.comments` has the rule); other comments stay.

Every candidate is priced compiled, as `mkc perf` prices it: by its own kernel's whole-kernel
measure where one is cached (the input's, with `--compiled` compiled when missing), else per op
(`mkc.perf.op_measures`): each op body by the measure of that body (shipped, cached, or compiled
alone the first time a candidate needs it, seconds), collectives' and kernel statements' cycles
from a whole-kernel measure of the spec at that batch. Only where nothing can compile (no
libtpu) are candidates counted, and the table says so first. Times are modelled (`mkc.perf`),
not measured.
"""
from __future__ import annotations

import bisect
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

from mkc import ir, target
from mkc.checks import run_checks
from mkc.checks.capacity import Kernel
from mkc.checks.expect import vmem_headroom
from mkc.diagnostics import MkcError, Span
from mkc.lang import ast
from mkc.lang.parser import parse
from mkc.lang.statements.collectives import scatter_text, written_scatter
from mkc.perf.comments import drop_stale_comments
from mkc.perf.run import kernel_measure, step_model
from mkc.resolve import resolve
from mkc.resolve.collectives import overlap_window

# Issue 18: every shipped spec keeps at least 1 MiB of VMEM headroom at its widest kernel.
MIN_HEADROOM = 1 << 20
# A change must shorten the mean modelled step by this much (the table's precision, 0.1 %):
# less is within the model's rounding and would only churn the spec.
MIN_GAIN = 1e-3
_TOKEN = re.compile(r"#[^\n]*|[A-Za-z_][A-Za-z0-9_]*|\d+|->|\S")


def _offset(lines_at: list[int], line: int, column: int) -> int:
    return lines_at[line - 1] + column - 1


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for i, ch in enumerate(text):
        if ch == "\n":
            starts.append(i + 1)
    return starts


@dataclass(frozen=True)
class Slot:
    """A run of the source [start, end) that one knob rewrites."""

    start: int
    end: int


@dataclass
class Knob:
    """One setting the tuner may change: its current value, the source it rewrites, how to
    print a value, and the values next to a value."""

    name: str                        # e.g. "ring weights", "kv tiles of mla"
    line: int
    value: tuple
    slots: tuple[Slot, ...]          # one source run per element of a rendered value
    render: Callable[[tuple], tuple[str, ...]]
    neighbours: Callable[[tuple], list[tuple]]
    show: Callable[[tuple], str] = str


@dataclass
class Evaluation:
    config: tuple
    text: str
    ok: bool
    steps: dict[int, float] = field(default_factory=dict)     # batch -> modelled seconds
    error: str = ""
    headroom: dict[Kernel, int] = field(default_factory=dict)    # VMEM bytes left in each

    @property
    def objective(self) -> float:
        return sum(self.steps.values()) / len(self.steps) if self.steps else float("inf")


class SpecSource:
    """The original text and its tokens, for finding a statement's integers and keywords."""

    def __init__(self, text: str):
        self.text = text
        self.lines = _line_starts(text)

    def span_range(self, span: Span) -> tuple[int, int]:
        return (_offset(self.lines, span.line, span.column),
                _offset(self.lines, span.end_line, span.end_column))

    def tokens(self, span: Span) -> list[tuple[str, int, int]]:
        """The statement's tokens (text, start, end), comments left out."""
        a, b = self.span_range(span)
        return [(m.group(), a + m.start(), a + m.end()) for m in _TOKEN.finditer(self.text[a:b])
                if not m.group().startswith("#")]

    def ints(self, span: Span) -> list[Slot]:
        return [Slot(a, b) for t, a, b in self.tokens(span) if t.isdigit()]


def _mult128(v: int) -> bool:
    return v >= 128 and v % 128 == 0


def find_knobs(sched: ast.Schedule, src: SpecSource, s: ir.ScheduleIR) -> list[Knob]:
    """Every tunable setting of the spec, with its source runs and neighbourhoods: the rings',
    the pools' expert slots, where each pooled kind's matrices live (pool view or ring), then
    each phase's KV tiles, all-reduce algorithms, prefetches and held-back refills."""
    knobs = _ring_knobs(sched, src) + _pool_knobs(sched, src) + _placement_knobs(sched, src, s)
    algorithms, scatters = _allreduce_algorithms(s), _scatter_forms(s)
    for phase in sched.phases:
        kname = phase.kind.text
        knobs += _kv_knobs(phase, kname, src, s)
        knobs += _allreduce_knobs(phase, kname, src, algorithms, scatters, s)
        knobs += _allgather_knobs(phase, kname, src, s)
        knobs += _prefetch_knobs(phase, kname, src, s)
        knobs += _refill_knobs(phase, kname, src, s)
    return knobs


def _ring_knobs(sched: ast.Schedule, src: SpecSource) -> list[Knob]:
    """Each ring's depth (its slots, with the stream's distance ahead when the stream gives
    one) and its tile bound."""
    knobs: list[Knob] = []
    streams = {st.ring.text: st for st in sched.streams}
    for ring in sched.rings:
        ints = src.ints(ring.span)
        st = streams.get(ring.name.text)
        if len(ints) != 3:
            continue
        if st is not None and src.ints(st.span):
            ahead_slot = src.ints(st.span)[0]
            knobs.append(Knob(
                f"ring {ring.name.text} slots / stream ahead", ring.span.line,
                (ring.slots, st.ahead), (ints[0], ahead_slot),
                lambda v: (str(v[0]), str(v[1])), _depth_neighbours,
                lambda v: f"{v[0]} slots, ahead {v[1]}"))
        else:
            knobs.append(Knob(f"ring {ring.name.text} slots", ring.span.line, (ring.slots,),
                              (ints[0],), lambda v: (str(v[0]),),
                              lambda v: [(v[0] + d,) for d in (-2, -1, 1, 2) if v[0] + d >= 2],
                              lambda v: f"{v[0]} slots"))
        knobs.append(Knob(f"ring {ring.name.text} tile bound", ring.span.line,
                          (ring.max_rows, ring.max_cols), (ints[1], ints[2]),
                          lambda v: (str(v[0]), str(v[1])), _tile_neighbours,
                          lambda v: f"up to {v[0]} x {v[1]}"))
    return knobs


def _depth_neighbours(v: tuple[int, int]) -> list[tuple[int, int]]:
    """(slots, ahead) near a ring's: more or fewer slots with the distance moved along, then
    the distance alone."""
    slots, ahead = v
    out = []
    for d in (-2, -1, 1, 2, 4):
        if slots + d >= 2:
            out.append((slots + d, max(1, min(ahead + d, slots + d))))
    for a in (ahead - 2, ahead - 1, ahead + 1):
        if 1 <= a <= slots and a != ahead:
            out.append((slots, a))
    return list(dict.fromkeys(o for o in out if o != v))


def _tile_neighbours(v: tuple[int, int]) -> list[tuple[int, int]]:
    """Tile bounds (rows, cols) a lane width or a factor of two away, multiples of 128."""
    r, c = v
    cands = [(r + 128, c), (r - 128, c), (r, c + 128), (r, c - 128), (2 * r, c),
             (r, 2 * c), (r // 2, c), (r, c // 2)]
    return list(dict.fromkeys(x for x in cands if _mult128(x[0]) and _mult128(x[1]) and x != v))


def _pool_knobs(sched: ast.Schedule, src: SpecSource) -> list[Knob]:
    """The slots of each pool view that has slots (routed experts)."""
    knobs: list[Knob] = []
    for pool in sched.pools:
        for view in pool.views:
            if view.slots:
                ints = src.ints(view.span)
                knobs.append(Knob(f"pool {pool.name.text}.{view.name.text} slots",
                                  view.span.line, (view.slots,), (ints[0],),
                                  lambda v: (str(v[0]),),
                                  lambda v: [(v[0] + d,) for d in (-2, -1, 1, 2) if v[0] + d >= 1],
                                  lambda v: f"{v[0]} slots"))
    return knobs


def _line_run(src: SpecSource, span: Span) -> Slot:
    """The whole source lines a span covers, their newline included."""
    a, b = src.span_range(span)
    a = src.text.rfind("\n", 0, a) + 1
    end = src.text.find("\n", b)
    return Slot(a, len(src.text) if end < 0 else end + 1)


def _placement_knobs(sched: ast.Schedule, src: SpecSource, s: ir.ScheduleIR) -> list[Knob]:
    """Where a kind's matrices live, for each kind a pool's weight view holds: whole in the
    view (fetched ahead by `prefetch next`) or in tiles through the stream's ring. A value is
    the matrices kept in the view, in consumption order; a neighbour moves one matrix across
    (the view keeps at least one; a matrix some op reads whole is refused by the checks). It
    rewrites the view's list and the kind's stream line (added before the stream's first line
    when the kind had none, removed when it streams nothing)."""
    knobs: list[Knob] = []
    if len(sched.streams) != 1:
        return knobs
    stream = sched.streams[0]
    if not stream.per_kind:
        return knobs
    lines = {sk.kind.text: sk for sk in stream.per_kind}
    first = _line_run(src, stream.per_kind[0].kind.span)
    indent = src.text[first.start:src.span_range(stream.per_kind[0].kind.span)[0]]
    for pool in sched.pools:
        for view in pool.views:
            for vk in view.kinds:
                kname = vk.kind.text
                if kname not in s.kinds:
                    continue
                ks = s.kinds[kname]
                order = list(dict.fromkeys(  # weights as ops take them: tiles or whole
                    f for op in ks.ops for f in ([ks.matmuls[op]] if op in ks.matmuls else [])
                    + list(ks.op_reads.get(op, ()))))
                pooled = [f.text for f in vk.families]
                line = lines.get(kname)
                streamed = [f.text for f in line.families] if line else []
                if any(n not in order for n in pooled + streamed):
                    continue
                movable = tuple(n for n in order if n in pooled or n in streamed)
                view_run = Slot(src.span_range(vk.families[0].span)[0],
                                src.span_range(vk.families[-1].span)[1])
                stream_run = (_line_run(src, line.kind.span) if line
                              else Slot(first.start, first.start))
                knobs.append(Knob(
                    f"placement of {kname} ({pool.name.text}.{view.name.text} or ring "
                    f"{stream.ring.text})", view.span.line, tuple(pooled), (view_run, stream_run),
                    lambda v, k=kname, m=movable, ind=indent: (
                        ", ".join(v), "" if len(v) == len(m) else
                        f"{ind}{k}: {', '.join(n for n in m if n not in v)}\n"),
                    lambda v, m=movable: _placement_neighbours(v, m),
                    lambda v, m=movable: f"pooled {', '.join(v)}; streamed "
                                         f"{', '.join(n for n in m if n not in v) or 'none'}"))
    return knobs


def _placement_neighbours(v: tuple[str, ...], movable: tuple[str, ...]) -> list[tuple[str, ...]]:
    """One matrix moved between the view and the ring: out of the view first."""
    out = [tuple(n for n in v if n != m) for m in v] if len(v) > 1 else []
    out += [tuple(n for n in movable if n in v or n == m) for m in movable if m not in v]
    return out


def _kv_knobs(phase: ast.Phase, kname: str, src: SpecSource, s: ir.ScheduleIR) -> list[Knob]:
    """A phase's KV tile streams: (slots, tokens per tile, ahead), tiles dividing the context."""

    def kv_neighbours(v: tuple[int, int, int]) -> list[tuple[int, int, int]]:
        slots, tokens, ahead = v
        cands = [(slots, tokens * 2, ahead), (slots, tokens // 2, ahead),
                 (slots + 1, tokens, ahead), (slots + 1, tokens, ahead + 1),
                 (slots - 1, tokens, min(ahead, slots - 1)),
                 (slots, tokens, ahead + 1), (slots, tokens, ahead - 1)]
        return list(dict.fromkeys(
            c for c in cands if c != v and c[0] >= 1 and 0 <= c[2] <= c[0]
            and c[1] >= 16 and s.context % c[1] == 0))

    return [Knob(f"kv tiles of {kname}", kv.span.line, (kv.slots, kv.tokens, kv.ahead),
                 tuple(src.ints(kv.span)[:3]), lambda v: tuple(str(x) for x in v), kv_neighbours,
                 lambda v: f"{v[0]} slots of {v[1]} tokens ahead {v[2]}")
            for kv in phase.kv_tiles]


def _allreduce_algorithms(s: ir.ScheduleIR) -> list[str]:
    """The all-reduce algorithms the topology offers: direct, and two_level within a chip or a
    host where it has more than one."""
    grid = tuple(int(x) for x in s.topology.split("=")[1].split("x"))
    chips = math.prod(grid)
    hosts = s.ranks // target.topology(s.chip, grid).cores_per_host
    algorithms = ["direct"]
    if s.cores_per_chip > 1 and chips > 1:
        algorithms.append("two_level chip")
    if hosts > 1:
        algorithms.append("two_level host")
    return algorithms


def _scatter_forms(s: ir.ScheduleIR) -> list[str]:
    """The scatter clauses to try after an all-reduce's wire dtype (each with its leading
    space): none (one-shot), at every kernel width, and from the widest kernel's rows (the
    one-shot stages kept below it, where a round more costs more than the bytes save)."""
    forms = ["", " " + scatter_text(None)]
    if s.rows_max > 1:
        forms.append(" " + scatter_text(s.rows_max))
    return forms


def _can_overlap(s: ir.ScheduleIR, kname: str, ops: list[ast.Name]) -> bool:
    """Whether a collective of each of these ops has ops to overlap (`overlap_window`)."""
    k = s.kinds.get(kname)
    if k is None or any(o.text not in k.ops for o in ops):
        return False
    scopes = [b.scope for b in s.buffers if b.scope and b.scope[0] == kname]
    try:
        for o in ops:
            overlap_window(k, o.text, scopes, o.span)
    except MkcError:
        return False
    return True


def _allreduce_knobs(phase: ast.Phase, kname: str, src: SpecSource, algorithms: list[str],
                     scatters: list[str], s: ir.ScheduleIR) -> list[Knob]:
    """A phase's all-reduces with another algorithm to try: the algorithm (and level) tokens,
    and the scatter and overlap clauses after the wire dtype (a candidate the check refuses is
    dropped like any other; overlap is offered only where ops would compute under it)."""
    knobs: list[Knob] = []
    for ar in phase.allreduces:
        overlaps = ("", OVERLAP) if _can_overlap(s, kname, ar.ops) else ("",)
        a = src.span_range(ar.algorithm.span)[0]
        b = src.span_range((ar.level or ar.algorithm).span)[1]
        wire_end = src.span_range(ar.wire_dtype.span)[1]
        clause_end = src.span_range(ar.span)[1]
        cur = (f"{ar.algorithm.text} {ar.level.text}" if ar.level else ar.algorithm.text,
               written_scatter(ar.scatter),
               OVERLAP if ar.overlap else "")
        opts = list(dict.fromkeys([cur] + [(alg, sc, ov) for alg in algorithms for sc in scatters
                                           for ov in overlaps]))
        if len(opts) > 1:
            ops = ", ".join(o.text for o in ar.ops)
            knobs.append(Knob(f"allreduce {ops} in {kname}", ar.span.line, cur,
                              (Slot(a, b), Slot(wire_end, clause_end)),
                              lambda v: (v[0], v[1] + v[2]),
                              lambda v, opts=opts: [o for o in opts if o != v],
                              lambda v: v[0] + v[1] + v[2]))
    return knobs


def _allgather_knobs(phase: ast.Phase, kname: str, src: SpecSource, s: ir.ScheduleIR) -> list[Knob]:
    """Whether each of a phase's all-gathers overlaps the ops after it (where ops would compute
    under it)."""
    knobs: list[Knob] = []
    for ag in phase.allgathers:
        if not _can_overlap(s, kname, ag.ops):
            continue
        group_end, end = src.span_range(ag.group.span)[1], src.span_range(ag.span)[1]
        ops = ", ".join(o.text for o in ag.ops)
        knobs.append(Knob(f"allgather {ops} in {kname}", ag.span.line,
                          (OVERLAP if ag.overlap else "",), (Slot(group_end, end),),
                          lambda v: v, lambda v: [("" if v[0] else OVERLAP,)],
                          lambda v: v[0] or "at once"))
    return knobs


OVERLAP = " overlap"


def _prefetch_knobs(phase: ast.Phase, kname: str, src: SpecSource, s: ir.ScheduleIR) -> list[Knob]:
    """Where each `prefetch next` of a phase starts: any program point of the kind."""
    knobs: list[Knob] = []
    for pf in phase.prefetches:
        toks = src.tokens(pf.span)
        _, view_end = src.span_range(pf.view.span)
        a = next(t[1] for t in toks if t[1] >= view_end)
        b = src.span_range(pf.start.anchor.span)[1]
        ops = s.kinds[kname].ops if kname in s.kinds else []
        points = ["at start"] + [f"after {op}" for op in ops[:-1]]
        cur = str(pf.start)
        if cur not in points:
            points.insert(0, cur)
        knobs.append(Knob(f"prefetch next {pf.view.text} in {kname}", pf.span.line,
                          (cur,), (Slot(a, b),), lambda v: (v[0],),
                          lambda v, points=points: _point_nb(points, v[0]),
                          lambda v: v[0]))
    return knobs


def _refill_knobs(phase: ast.Phase, kname: str, src: SpecSource, s: ir.ScheduleIR) -> list[Knob]:
    """After which op each `refill` releases the ring refills it holds back: any op of the kind
    (one no ring tile is read up to fails its check and is dropped)."""
    if kname not in s.kinds:            # a kind the model does not run
        return []
    knobs: list[Knob] = []
    for r in phase.refills:
        a, b = src.span_range(r.start.anchor.span)
        points, cur = s.kinds[kname].ops, r.start.anchor.text
        knobs.append(Knob(f"refill {r.ring.text} in {kname}", r.span.line, (cur,), (Slot(a, b),),
                          lambda v: (v[0],), lambda v, points=points: _point_nb(points, v[0]),
                          lambda v: f"after {v[0]}"))
    return knobs


def _point_nb(points: list[str], cur: str) -> list[tuple]:
    """Program points near the current one first (one and two ops either side), then the
    rest: the search tries the near ones when the budget is short."""
    i = points.index(cur)
    order = sorted(range(len(points)), key=lambda j: (abs(j - i), j))
    return [(points[j],) for j in order if j != i]


def render(text: str, knobs: list[Knob], config: tuple) -> str:
    """The original text with each knob whose value differs rewritten in place."""
    edits = []
    for knob, value in zip(knobs, config):
        if value == knob.value:
            continue
        new = knob.render(value)
        old = knob.render(knob.value)
        for slot, o, n in zip(knob.slots, old, new):
            if o != n:
                edits.append((slot.start, slot.end, n))
    out = text
    for a, b, n in sorted(edits, reverse=True):
        out = out[:a] + n + out[b:]
    return out


def check_text(text: str, file: str, model: str | None) -> ir.ScheduleIR:
    """`mkc check` on text as if it were the file at `file`: parse, resolve, every check."""
    return checked_text(text, file, model)[0]


def checked_text(text: str, file: str, model: str | None) -> tuple[ir.ScheduleIR, list]:
    """`check_text`, with the checked trace (the VMEM peaks are read from it)."""
    s = resolve(parse(text, file), model)
    return s, run_checks(s)


@dataclass
class TuneResult:
    knobs: list[Knob]
    before: Evaluation
    best: Evaluation
    evaluations: int
    rejected: int
    seconds: float
    batches: list[int]
    history: list[str]
    min_headroom: int = 0           # VMEM bytes a candidate must leave in every kernel
    short_of_headroom: int = 0      # candidates refused for leaving less
    priced_by: str = ""             # the compiled measures every candidate is priced by, or why counted

    def changed(self) -> list[tuple[Knob, tuple, tuple]]:
        return [(k, k.value, v) for k, v in zip(self.knobs, self.best.config) if v != k.value]

    @property
    def text(self) -> str:
        """The spec to write: the best candidate, each changed statement's comments that
        state numbers (of the old value) replaced by a note of the change
        (`mkc.perf.comments`)."""
        notes: dict[int, list[str]] = {}
        lines = SpecSource(self.before.text).lines      # the knobs' offsets are the input's
        changed: dict[int, str | None] = {}
        for k, old, new in self.changed():
            changed.update({bisect.bisect_right(lines, sl.start): None for sl in k.slots})
            notes.setdefault(k.line, []).append(f"{k.name} {k.show(old)} -> {k.show(new)}")
        gain = self.before.objective / self.best.objective - 1
        faster = f" (the tuned spec's mean modelled step {gain:.1%} shorter)"
        changed.update({line: "# `mkc tune`: " + "; ".join(n) + faster for line, n in notes.items()})
        return drop_stale_comments(self.best.text, changed)


def _gains(ev: Evaluation, over: Evaluation) -> bool:
    """Whether `ev` passed and shortens `over`'s objective by MIN_GAIN or more."""
    return ev.ok and ev.objective <= over.objective * (1 - MIN_GAIN)


def _prune(knobs: list[Knob], start: tuple, best: Evaluation, evaluate: Callable[[tuple], Evaluation],
           spent: Callable[[], bool], log: Callable[[str], None]) -> Evaluation:
    """`best` with each change reverted in turn (while the budget is not `spent`) where the
    change alone gains less than MIN_GAIN over its reversal."""
    for i, knob in enumerate(knobs):
        if best.config[i] == start[i] or spent():
            continue
        ev = evaluate(best.config[:i] + (start[i],) + best.config[i + 1:])
        if ev.ok and not _gains(best, ev):
            log(f"{knob.name}: kept at {knob.show(start[i])} ({knob.show(best.config[i])} gains under "
                f"{MIN_GAIN:.1%}): {_ms(ev)}")
            best = ev
    return best


def _descend(knobs: list[Knob], best: Evaluation, evaluate: Callable[[tuple], Evaluation],
             spent: Callable[[], bool], accept: Callable[[Evaluation, str], None]) -> None:
    """Coordinate descent from `best`: each knob in turn moved to its best neighbour (each move
    `accept`ed), sweep after sweep while one improves the objective and the budget is not
    `spent`."""
    improved = True
    while improved and not spent():
        improved = False
        for i, knob in enumerate(knobs):
            if spent():
                break
            trial_best = best
            for value in knob.neighbours(best.config[i]):
                if spent():
                    break
                ev = evaluate(best.config[:i] + (value,) + best.config[i + 1:])
                if _gains(ev, best) and ev.objective < trial_best.objective:
                    trial_best = ev
            if trial_best is not best:
                old = knob.show(best.config[i])
                accept(trial_best, f"{knob.name}: {old} -> "
                                   f"{knob.show(trial_best.config[i])}: {_ms(trial_best)}")
                best, improved = trial_best, True


def tune(text: str, file: str, model: str | None = None, budget: int = 80,
         log: Callable[[str], None] | None = None,
         select: Callable[[Knob], bool] | None = None,
         min_headroom: int = MIN_HEADROOM,
         evaluated: Callable[[], None] | None = None, compiled: bool | None = None,
         on_compile: Callable[[], None] | None = None) -> TuneResult:
    """Coordinate descent over the spec's knobs (module docstring); `budget` caps the
    evaluations (the first, of the spec as written, included); `select` keeps only some
    knobs; a candidate leaving less than `min_headroom` bytes of VMEM in a kernel is
    refused. `evaluated` is called after each evaluation (a progress bar's tick). The input
    is priced by its compiled measures (`compiled` as `run.kernel_measure` takes it), every
    other candidate by its own kernel's, whole where cached, else per op
    (`mkc.perf.op_measures`); counted only with `compiled` False or where nothing
    compiles."""
    t0 = time.perf_counter()
    log = log or (lambda _: None)
    evaluated = evaluated or (lambda: None)
    sched = parse(text, file)
    s0 = check_text(text, file, model)          # the input must pass: MkcError otherwise
    src = SpecSource(text)
    knobs = [k for k in find_knobs(sched, src, s0) if select is None or select(k)]
    batches = sorted({s0.batch_min, s0.batch_max})
    measures = {b: kernel_measure(s0, b, compiled=compiled, on_compile=on_compile)
                for b in batches}
    how: dict[str, int] = {"whole kernel": 0, "per op": 0, "counted": 0}
    cache: dict[tuple, Evaluation] = {}
    rejected = short = 0
    start = tuple(k.value for k in knobs)

    def evaluate(config: tuple) -> Evaluation:
        if config not in cache:
            t = time.perf_counter()
            cache[config] = _evaluate(config)
            if len(cache) == 2 and budget > 2:      # the first candidate, priced as the rest are
                each = time.perf_counter() - t
                log(f"estimate: {each:.1f} s the first candidate; {budget - 2} more at most, about "
                    f"{_duration(each * (budget - 2))} (longer where op bodies are first compiled)")
            evaluated()
        return cache[config]

    def _evaluate(config: tuple) -> Evaluation:
        nonlocal rejected, short
        cand = render(text, knobs, config)
        ev = Evaluation(config, cand, ok=False)
        try:
            s, events = checked_text(cand, file, model)
            ev.headroom = vmem_headroom(s, events)
            # The input is the baseline whatever its headroom; a change must keep the margin.
            if config != start and min(ev.headroom.values()) < min_headroom:
                ev.error, short = "headroom", short + 1
                rejected += 1
                return ev
            ev.ok = True
            ev.steps = {}
            for b in batches:
                m = measures[b][0] if config == start else _candidate_measure(s, b, compiled)
                ev.steps[b] = step_model(s, b, s.context, keep_timeline=False,
                                         compiled=m).step_s
                how[_how(m)] += 1
        except MkcError as e:
            ev.error = e.diagnostics[0].code
            rejected += 1
        return ev

    before = evaluate(start)
    log(f"start: {_ms(before)}")
    best, history = _search(knobs, start, before, evaluate, s0, budget, lambda: len(cache), min_headroom,
                            log)
    return TuneResult(knobs, before, best, len(cache), rejected, time.perf_counter() - t0,
                      batches, history, min_headroom, short, _priced_by(measures, how))


def _search(knobs: list[Knob], start: tuple, before: Evaluation, evaluate: Callable[[tuple], Evaluation],
            s0: ir.ScheduleIR, budget: int, used: Callable[[], int], min_headroom: int,
            log: Callable[[str], None]) -> tuple[Evaluation, list[str]]:
    """Coordinate descent and coupled moves from `before` while the budget lasts (`used`
    evaluations so far), each change holding one evaluation back for its reversal (`_prune`;
    one change's reversal is the input, evaluated already), then the reversals -> (the best,
    or `before` where the best does not gain; the moves logged)."""
    best, history = before, []

    def note(msg: str) -> None:
        history.append(msg)
        log(msg)

    def accept(ev: Evaluation, msg: str) -> None:
        nonlocal best
        best = ev
        note(msg)

    def left() -> int:
        changes = sum(v != w for v, w in zip(best.config, start))
        return budget - used() - (changes if changes > 1 else 0)

    while True:
        _descend(knobs, best, evaluate, lambda: left() <= 0, accept)
        moved = _respend(knobs, best, evaluate, s0, left(), min_headroom)
        if moved is None:
            break
        ev, msg = moved
        accept(ev, f"{msg}: {_ms(ev)}")
    best = _prune(knobs, start, best, evaluate, lambda: used() >= budget, note)
    return (best if _gains(best, before) else before), history


def _candidate_measure(s: ir.ScheduleIR, batch: int, compiled: bool | None) -> dict | None:
    """A candidate's compiled measure: its whole kernel's if cached, else per op (compiling
    missing op bodies alone); None (counted) with `compiled` False or nothing compiling."""
    if compiled is False:
        return None
    return kernel_measure(s, batch, compiled=None)[0]


def _how(m: dict | None) -> str:
    return "counted" if m is None else "per op" if "op_level" in m else "whole kernel"


def _respend(knobs: list[Knob], best: Evaluation, evaluate: Callable[[tuple], Evaluation],
             s: ir.ScheduleIR, budget: int, min_headroom: int) -> tuple[Evaluation, str] | None:
    """A coupled move coordinate descent cannot find, since its first half alone is slower:
    a placement neighbour that frees VMEM (a matrix out of a pool view shrinks the pool), with
    the bytes freed spent on ring slots (slots and the distance ahead grown alike). The best
    improving pair, or None."""
    ring = next((i for i, k in enumerate(knobs) if k.name.endswith("slots / stream ahead")), None)
    if ring is None or s.stream is None:
        return None
    slot_bytes = s.stream.tile_rows * s.stream.tile_cols * ir.DTYPE_BYTES[s.stream.dtype]
    found: tuple[Evaluation, str] | None = None
    for i, knob in enumerate(knobs):
        if not knob.name.startswith("placement of "):
            continue
        for value in knob.neighbours(best.config[i]):
            if budget <= 0:
                return found
            moved = best.config[:i] + (value,) + best.config[i + 1:]
            ev, budget = evaluate(moved), budget - 1
            if not ev.ok:
                continue
            spare = (min(ev.headroom.values()) - min_headroom) // slot_bytes
            slots, ahead = moved[ring]
            for n in range(spare, 0, -1):
                if budget <= 0:
                    break
                depth = (slots + n, ahead + n)
                config = moved[:ring] + (depth,) + moved[ring + 1:]
                pair, budget = evaluate(config), budget - 1
                if _gains(pair, best) and (found is None or pair.objective < found[0].objective):
                    found = (pair, f"{knob.name}: {knob.show(best.config[i])} -> "
                                   f"{knob.show(value)}, {knobs[ring].name}: "
                                   f"{knobs[ring].show(moved[ring])} -> {knobs[ring].show(depth)}")
                    break
    return found


def _priced_by(measures: dict[int, tuple[dict | None, str]], how: dict[str, int]) -> str:
    """What the steps are priced by: "counted: ..." when any was counted."""
    steps = ", ".join(f"{n} {k}" for k, n in how.items() if n)
    whys = "; ".join(f"B{b}: {why}" for b, (m, why) in measures.items() if m is None and why)
    if how["counted"]:
        return (f"counted where nothing compiled: steps priced {steps} (mkc.perf.op_measures)"
                + (f"; {whys}" if whys else ""))
    return (f"compiled: steps priced {steps} (per op: each op body's libtpu cycles, "
            "mkc.perf.op_measures)")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _ms(ev: Evaluation) -> str:
    return ", ".join(f"B{b} {t * 1e3:.3f} ms" for b, t in ev.steps.items())


def table(res: TuneResult, spec: str) -> str:
    """The before/after table: changed settings, then the modelled step per batch."""
    lines = [f"mkc tune {spec}: {res.evaluations} evaluations ({res.rejected} rejected by the "
             f"checks, {res.short_of_headroom} of them for leaving under "
             f"{res.min_headroom / 2**20:.2f} MiB of VMEM headroom) in {res.seconds:.1f} s; "
             f"objective: mean modelled step over batches "
             f"{', '.join(map(str, res.batches))} (modelled, not measured)",
             f"  priced by {res.priced_by}"]
    if res.priced_by.startswith("counted"):
        lines.insert(0, "COUNTED PRICES, not compiled, for some steps: counted prices have been "
                        "1.7-4.2x off compiled ones and can reverse rankings")
    changed = res.changed()
    if not changed:
        lines.append("no change found that shortens the modelled step; the spec is kept as is")
    else:
        w = max(len(k.name) for k, _, _ in changed)
        lines.append(f"  {'setting':<{w}}  line  {'before':<34} after")
        for k, old, new in changed:
            lines.append(f"  {k.name:<{w}}  {k.line:4d}  {k.show(old):<34} {k.show(new)}")
    lines.append(f"  {'batch':>5} {'before ms':>10} {'after ms':>10} {'before tok/s':>13} "
                 f"{'after tok/s':>12} {'gain':>7}")
    for b in res.batches:
        t0, t1 = res.before.steps[b], res.best.steps[b]
        lines.append(f"  {b:>5} {t0 * 1e3:10.3f} {t1 * 1e3:10.3f} {b / t0:13.0f} {b / t1:12.0f} "
                     f"{100 * (t0 / t1 - 1):+6.1f}%")
    lines.append("  VMEM headroom of the spec written, in each kernel it builds: " + "; ".join(
        f"{k} {h / 2**20:.2f} MiB" for k, h in res.best.headroom.items())
        + f" (margin {res.min_headroom / 2**20:.2f} MiB)")
    if min(res.best.headroom.values()) < res.min_headroom:
        lines.append("  the input itself leaves less than the margin: it is written unchanged "
                     "(no candidate met the margin and was faster)")
    return "\n".join(lines)

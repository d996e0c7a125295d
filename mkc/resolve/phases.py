"""Passes `layer_kinds` (a phase block per layer kind the model runs) and `phases` (each
phase's state copies, scoped ranges and KV tiles, as the layer kind's schedule)."""
from __future__ import annotations

import dataclasses
import difflib
from collections import Counter

from mkc import ir
from mkc.diagnostics import fail
from mkc.lang import ast
from mkc.lang.statements.copies import Binding, Transfer
from mkc.lang.statements.kv import KvTiles
from mkc.lang.statements.scoped import Scoped
from mkc.model.graph import LayerKind
from mkc.resolve.names import unknown, unused_kind, validate_identifier
from mkc.resolve.state import ResolveState


def resolve_layer_kinds(s: ResolveState) -> ResolveState:
    sched, graph = s.sched, s.graph
    written = {p.kind.text for p in sched.phases}
    missing = [k for k in sorted(set(s.dims.layer_kinds)) if k not in written]
    phases: dict[str, ast.Phase] = {}
    for p in sched.phases:
        if unused_kind(s, p.kind.text):
            continue
        if p.kind.text not in graph.kinds:
            raise unknown("layer kind", p.kind, sorted(graph.kinds))
        if p.kind.text in phases:
            raise fail("E-DUPLICATE", f"phase {p.kind.text} is written twice", p.kind.span,
                       hint="merge the two phase blocks")
        phases[p.kind.text] = p
    if missing:
        raise fail("E-MISSING", f"no phase for layer kind(s) {', '.join(missing)} of "
                   f"{s.dims.name}", sched.name.span,
                   hint=f"add `phase {missing[0]} {{ ... }}` with its allreduces and state copies")
    return dataclasses.replace(s, phases=phases)


def resolve_phases(s: ResolveState) -> ResolveState:
    """Each layer kind's schedule without its KV ring, collectives and view copies (later
    passes resolve them), and the VMEM buffers its state copies and KV tiles use."""
    kinds: dict[str, ir.KindSchedule] = {}
    kind_buffers: dict[str, tuple[ir.Buffer, ...]] = {}
    for kname in sorted(s.graph.kinds):
        if kname not in s.dims.layer_kinds:
            continue
        phase, kind = s.phases[kname], s.graph.kinds[kname]
        _resolve_buffer_names(phase, kind)
        transfers, buffers = _transfers(phase, kind, s.batch[1])
        buffers = _scoped(phase, kind, buffers)
        kv, kv_buffers = _kv_tiles(phase, kind, s.batch[1], s.context)
        kinds[kname] = _kind_schedule(kind, s, transfers, kv)
        kind_buffers[kname] = tuple((buffers | kv_buffers).values())
    return dataclasses.replace(s, phase_schedules=kinds, kind_buffers=kind_buffers)


def _resolve_buffer_names(phase: ast.Phase, kind: LayerKind) -> None:
    """Every name of a phase's VMEM buffer, as its statements write it: a `load` makes the
    buffer it fills; a `store` copies out of, and a `scoped` line holds, one a load fills. A
    misspelling is the spelling fewer statements give: a load's name no other statement gives,
    close to one that several others give but no load fills, is the misspelt one; otherwise a
    name a load does not fill is (`did you mean` either way, at the name)."""
    kname, states = kind.name, state_tensors(kind)
    for tr in phase.transfers:          # each binding's sides first: which is the buffer
        for b in tr.bindings:
            _binding(tr, b, kname, states)
    named: list[tuple[ast.Name, str, int]] = []     # (name, statement kind, statement index)
    for i, tr in enumerate(phase.transfers):
        named += [((b.dst if tr.direction == "load" else b.src), tr.direction, i)
                  for b in tr.bindings]
    named += [(n, "scoped", len(phase.transfers) + i) for i, sc in enumerate(phase.scoped)
              for n in sc.buffers]
    statements: dict[str, set[int]] = {}
    for n, _, i in named:
        statements.setdefault(n.text, set()).add(i)
    loaded = sorted({n.text for n, role, _ in named if role == "load"})
    for n, role, i in named:
        others = sorted({m.text for m, _, j in named if j != i})
        close = difflib.get_close_matches(n.text, others, n=1)
        if (role == "load" and statements[n.text] == {i} and close and close[0] not in loaded
                and len(statements[close[0]]) > 1):
            lines = sorted({m.span.line for m, _, _ in named if m.text == close[0]})
            raise unknown(f"buffer of phase {kname}", n, others,
                          notes=[f"no other statement names '{n.text}'; lines "
                                 f"{', '.join(map(str, lines))} name '{close[0]}', which no load "
                                 "fills"])
    for n, role, _ in sorted(named, key=lambda x: (x[0].span.line, x[0].span.column)):
        if role != "load" and n.text not in loaded:
            raise unknown(f"buffer of phase {kname}", n, loaded,
                          notes=[f"a `{role}` line names a buffer that a `load` of phase "
                                 f"{kname} fills"])


def point(p: ast.Point, ops: list[str], kind: str) -> int:
    """A program point of layer kind `kind`: before op p is p, the end is len(ops)."""
    a = p.anchor.text
    if p.where == "at":
        if a == "start":
            return 0
        if a == "end":
            return len(ops)
        raise fail("E-UNKNOWN", f"unknown program point 'at {a}'", p.anchor.span,
                   hint="use 'at start', 'at end', 'before OP' or 'after OP'")
    if a in ("start", "end") and a not in ops:
        raise fail("E-UNKNOWN", f"'{p.where} {a}' is not a program point: {a} is not an op",
                   p.anchor.span, hint=f"write `at {a}`")
    if a not in ops:
        raise unknown(f"op of layer kind {kind}", p.anchor, ops)
    i = ops.index(a)
    return i if p.where == "before" else i + 1


def state_tensors(kind: LayerKind) -> dict:
    """The kind's tensors of role "state" (carried from step to step), by name."""
    return {t.name: t for t in kind.states() if t.role == "state"}


def _kind_schedule(kind: LayerKind, s: ResolveState, transfers: list[ir.Transfer],
                   kv: ir.KvStream | None) -> ir.KindSchedule:
    # What an op passes and returns in registers: not a tensor, not a VMEM activation buffer.
    not_values = set(kind.tensors) | set(s.graph.activations) | {"x"}
    return ir.KindSchedule(
        name=kind.name, ops=kind.op_names(),
        matmuls={o.name: o.matmul for o in kind.ops if o.matmul},
        transfers=transfers, kv=kv, allreduces=[],
        vectors=[(t.name, t.shape) for t in kind.vectors()],
        states={n: (t.shape, t.dtype) for n, t in state_tensors(kind).items()},
        op_reads={o.name: list(o.reads) for o in kind.ops},
        op_writes={o.name: list(o.writes) for o in kind.ops},
        op_values={o.name: ([n for n in o.reads if n not in not_values],
                            [n for n in o.writes if n not in not_values]) for o in kind.ops},
        pooled=dict(s.pooled.get(kind.name, {})))


def _transfers(phase: ast.Phase, kind: LayerKind, B: int
               ) -> tuple[list[ir.Transfer], dict[str, ir.Buffer]]:
    """`load`/`store` lines: each binds a state family in HBM to a VMEM buffer of the phase."""
    kname, ops, states = kind.name, kind.op_names(), state_tensors(kind)
    buffers: dict[str, ir.Buffer] = {}
    bound: dict[str, str] = {}          # buffer -> state family
    transfers: list[ir.Transfer] = []
    # The ops read a state from the buffer it is loaded into: only a state loaded once has
    # readers its load alone must precede (more than one load is the trace's to judge).
    loads = Counter(b.src.text for tr in phase.transfers if tr.direction == "load"
                    for b in tr.bindings)
    for tr in phase.transfers:
        copied: list[str] = []          # the statement's state families
        for b in tr.bindings:
            sname, bname, vmem_side = _binding(tr, b, kname, states)
            copied.append(sname)
            if bname in bound and bound[bname] != sname:
                raise fail("E-TRANSFER", f"buffer '{bname}' is bound to state.{bound[bname]} "
                           f"and state.{sname}", vmem_side.span,
                           hint="use one VMEM buffer per state family")
            bound[bname] = sname
            t = states[sname]
            # Leading dims of a state (conv taps) go first so the kernel indexes them cheaply.
            shape = (*t.shape[:t.lead_dims], B, *t.shape[t.lead_dims:])
            buffers[bname] = ir.Buffer(f"{kname}_{bname}", "state", shape, t.dtype,
                                       batch_axis=t.lead_dims, span=tr.span, written=bname)
            drains = _drains(tr, kname)
            if any((t.direction, t.state, t.buffer) == (tr.direction, sname, f"{kname}_{bname}")
                   for t in transfers):
                raise fail("E-DUPLICATE", f"state.{sname} is "
                           f"{'loaded' if tr.direction == 'load' else 'stored'} "
                           f"{'into' if tr.direction == 'load' else 'from'} {bname} twice",
                           b.src.span, hint=f"keep one `{tr.direction}` of state.{sname}")
            transfers.append(ir.Transfer(
                tr.direction, sname, f"{kname}_{bname}", point(tr.start, ops, kname),
                tuple(point(w, ops, kname) for w in tr.waits if w.where != "before next"),
                drain=drains, span=tr.span))
        _check_copy_order(tr, kind, [n for n in copied if loads[f"state.{n}"] <= 1])
    _check_every_state_copied(phase, kname, states, transfers)
    return transfers, buffers


def _binding(tr: Transfer, b: Binding, kname: str, states: dict
             ) -> tuple[str, str, ast.Name]:
    """(state family, buffer name, the buffer's name in the spec) of one `A -> B` binding."""
    hbm_side, vmem_side = (b.src, b.dst) if tr.direction == "load" else (b.dst, b.src)
    if not hbm_side.text.startswith("state."):
        raise fail("E-TRANSFER", f"the HBM side of a {tr.direction} must name "
                   f"`state.<family>`, got '{hbm_side.text}'", hbm_side.span,
                   hint=f"{kname} state families: " + ", ".join(f"state.{s}" for s in states))
    sname = hbm_side.text.split(".", 1)[1]
    if sname not in states:
        raise unknown(f"state of layer kind {kname}", ast.Name(sname, hbm_side.span),
                      sorted(states))
    return sname, validate_identifier(vmem_side, "buffer"), vmem_side


def _drains(tr: Transfer, kname: str) -> int:
    """How many `wait before next KIND` drains a copy has, its start and waits checked."""
    if tr.start.where == "before next":
        raise fail("E-TRANSFER", "a copy cannot start `before next ...`",
                   tr.start.anchor.span, hint="start it at a point of this layer")
    points = [(w.where, w.anchor.text) for w in tr.waits]
    dup = next((w for i, w in enumerate(tr.waits) if (w.where, w.anchor.text) in points[:i]),
               None)
    if dup is not None:
        raise fail("E-DUPLICATE", f"the {tr.direction} is waited twice at "
                   f"`{dup.where} {dup.anchor.text}`", dup.anchor.span,
                   hint="wait for each copy once: remove the repeated `wait`")
    drains = [w for w in tr.waits if w.where == "before next"]
    for w in drains:
        if w.anchor.text != kname:
            raise fail("E-TRANSFER", f"phase {kname} can only drain before the next "
                       f"{kname} layer, not '{w.anchor.text}'", w.anchor.span,
                       hint=f"write `wait before next {kname}`")
    return len(drains)


def _check_copy_order(tr: Transfer, kind: LayerKind, copied: list[str]) -> None:
    """A copy is waited after it starts; a load of `copied` states starts and is waited before
    the first op reading one, and a store of them starts after the last op updating it. Each
    mistake is one diagnostic at its cause: the trace would show only its consequences, at the
    ops and copies downstream (or, for a wait before the start, none: the layer program never
    reaches such a wait)."""
    kname, ops = kind.name, kind.op_names()
    start = point(tr.start, ops, kname)
    waits = [(w, point(w, ops, kname)) for w in tr.waits if w.where != "before next"]
    first_read = min(((kind.readers(s)[0], s) for s in copied if kind.readers(s)), default=None)
    if tr.direction == "load" and first_read is not None:
        _check_load_starts_in_time(tr, ops, start, first_read)
    if tr.direction == "store":
        _check_store_starts_in_time(tr, kind, start, copied)
    for w, p in waits:
        if p < start:
            raise fail("E-DMA-WAIT", f"the {tr.direction} is waited `{w}`, before it starts "
                       f"`{tr.start}`: there is no copy in flight to wait for", w.anchor.span,
                       hint=_wait_hint(tr, ops, first_read, kname))
    if tr.direction == "load" and first_read is not None:
        reader, sname = ops[first_read[0]], first_read[1]
        if not any(p <= first_read[0] for _, p in waits):
            late = waits[0][0] if waits else tr.waits[0]
            why = (f"its wait `{late}` comes after it" if waits else
                   f"`wait before next {kname}` waits for it only at the next {kname} layer")
            raise fail("E-READ-BEFORE-WAIT", f"{reader} reads state.{sname} while the load "
                       f"into its buffer has not been waited: {why}", late.anchor.span,
                       hint=f"wait for the load before {reader}: write `wait before {reader}`")


def _check_load_starts_in_time(tr: Transfer, ops: list[str], start: int,
                               first_read: tuple[int, str]) -> None:
    i, sname = first_read
    if start > i:
        raise fail("E-READ-BEFORE-WAIT", f"the load of state.{sname} starts `{tr.start}`, "
                   f"after {ops[i]} reads it: {ops[i]} would read a buffer the load has not "
                   "filled", tr.span,
                   hint=f"start the load before {ops[i]}, its first reader, and wait for it "
                        f"there: e.g. `{_copy_text(tr)} at start; wait before {ops[i]}`")


def _check_store_starts_in_time(tr: Transfer, kind: LayerKind, start: int,
                                copied: list[str]) -> None:
    """A store copies out the state as the layer's ops left it: it starts after the last op
    that updates it."""
    ops = kind.op_names()
    for sname in copied:
        writers = [i for i, o in enumerate(kind.ops) if sname in o.writes]
        if writers and start <= writers[-1]:
            op = ops[writers[-1]]
            raise fail("E-READ-BEFORE-WAIT", f"the store of state.{sname} starts `{tr.start}`, "
                       f"before {op} updates it: it would copy out the state as loaded, not "
                       "as this layer leaves it", tr.span,
                       hint=f"start the store after {op}, the last op updating state.{sname}: "
                            f"`{_copy_text(tr)} after {op}; wait ...`")


def _wait_hint(tr: Transfer, ops: list[str], first_read: tuple[int, str] | None,
               kname: str) -> str:
    """How to fix a wait placed before its copy starts."""
    if tr.direction == "load" and first_read is not None:
        return (f"wait after the load starts and before {ops[first_read[0]]} reads it: "
                f"`wait before {ops[first_read[0]]}`")
    if any(w.where == "before next" for w in tr.waits):
        return f"remove it: the {tr.direction} is also waited `before next {kname}`"
    start = point(tr.start, ops, kname)
    later = f"after {ops[start]}" if start < len(ops) else "at end"
    return (f"wait at or after its start, e.g. `wait {later}`, or `wait before next {kname}` "
            "to let it drain behind the rest of the layer")


def _copy_text(tr: Transfer) -> str:
    """`load A -> B, C -> D`: a copy statement up to its start point, for hints."""
    return f"{tr.direction} " + ", ".join(f"{b.src.text} -> {b.dst.text}" for b in tr.bindings)


def _check_every_state_copied(phase: ast.Phase, kname: str, states: dict,
                              transfers: list[ir.Transfer]) -> None:
    for sname in states:
        for direction in ("load", "store"):
            if not any(t.state == sname and t.direction == direction for t in transfers):
                raise fail("E-TRANSFER", f"state.{sname} of {kname} is never "
                           f"{'loaded' if direction == 'load' else 'stored'}",
                           phase.kind.span,
                           hint=f"add `{direction} ...` for state.{sname} in phase {kname}")


def _scoped(phase: ast.Phase, kind: LayerKind, buffers: dict[str, ir.Buffer]
            ) -> dict[str, ir.Buffer]:
    """`scoped BUFFERS from OP to OP`: the buffers, each held only over its range."""
    kname, ops = kind.name, kind.op_names()
    buffers = dict(buffers)
    ranges: list[tuple[int, int, Scoped]] = []
    for sc in phase.scoped:
        first, last = (_scope_end(sc, sc.first, "start", 0, ops, kname),
                       _scope_end(sc, sc.last, "end", len(ops) - 1, ops, kname))
        if last < first:
            raise fail("E-SCOPE", f"scope ends at {sc.last.text} before it starts at "
                       f"{sc.first.text}", sc.span, hint="swap the two ends")
        for n in sc.buffers:       # each a buffer a load fills (`_resolve_buffer_names`)
            b = buffers[n.text]
            if b.scope is not None:
                raise fail("E-DUPLICATE", f"{n.text} is scoped twice", n.span,
                           hint=f"the first `scoped` range of it is at line {b.span.line}")
            buffers[n.text] = dataclasses.replace(b, scope=(kname, first, last), span=sc.span)
        ranges.append((first, last, sc))
    _check_scopes_nest(ranges, ops)
    return buffers


def _scope_end(sc: Scoped, name: ast.Name, word: str, at_word: int, ops: list[str],
               kname: str) -> int:
    """The op index a scoped range's end names: an op, or `start` (first end only) / `end`
    (last end only) of the layer."""
    if name.text == word:
        return at_word
    other = {"start": "end", "end": "start"}[word]
    if name.text == other:
        # Swapped, `other` stands where it belongs: the range is reversed unless both ends are it.
        reversed_ = sc.first.text != sc.last.text
        buffers = ", ".join(n.text for n in sc.buffers)
        raise fail("E-SCOPE", f"a scoped range runs from an op or `start` to an op or `end`: "
                   f"`{other}` cannot {'end' if word == 'end' else 'begin'} it", name.span,
                   hint=(f"the range is reversed: write `scoped {buffers} from {sc.last.text} "
                         f"to {sc.first.text}`") if reversed_ else
                   f"write `{word}` or an op of {kname} ({', '.join(ops)})")
    if name.text not in ops:
        raise unknown(f"op of layer kind {kname}", name, ops)
    return ops.index(name.text)


def _check_scopes_nest(ranges: list[tuple[int, int, Scoped]], ops: list[str]) -> None:
    """Scoped ranges must nest or be disjoint: each lowers to one `pl.run_scoped` block, and
    blocks cannot cross. A range from op a to op b holds its buffers over points a..b+1."""
    for i, (f1, l1, a) in enumerate(ranges):
        for f2, l2, b in ranges[i + 1:]:
            if (f1, l1) == (f2, l2) or l1 < f2 or l2 < f1:
                continue
            if (f1 <= f2 and l2 <= l1) or (f2 <= f1 and l1 <= l2):
                continue
            first, second = (a, b) if f1 <= f2 else (b, a)
            raise fail("E-SCOPE", "two scoped ranges cross: each must lie inside the other or "
                       "end before the other starts", second.span,
                       notes=[f"the other range is at line {first.span.line}"],
                       hint=f"nest them, or end `{first.last.text}` range before "
                            f"`{second.first.text}` (ops in order: {', '.join(ops)})")


def _kv_tiles(phase: ast.Phase, kind: LayerKind, B: int, context: int
              ) -> tuple[ir.KvStream | None, dict[str, ir.Buffer]]:
    """`kv tiles N slots of T tokens ahead A`: how the KV cache streams through VMEM, with
    its tile buffers and the buffer the new token's K/V rows are written through."""
    kname, caches = kind.name, kind.caches()
    if len(phase.kv_tiles) > 1:
        raise fail("E-DUPLICATE", "kv tiles declared twice", phase.kv_tiles[1].span,
                   hint="keep one `kv tiles` line")
    if not phase.kv_tiles:
        if caches:
            raise fail("E-KV", f"layer kind {kname} reads a KV cache but the phase does not "
                       "say how", phase.kind.span,
                       hint="add `kv tiles 2 slots of 128 tokens ahead 1`")
        return None, {}
    k = phase.kv_tiles[0]
    # a window's KV ring (`kv ring`, `mkc.resolve.kv_ring`) holds whole tiles, not the context
    _check_kv_tiles(k, kname, bool(caches), 0 if phase.kv_rings else context)
    reader, writer = kind.cache_reader(), kind.cache_writer()
    a = kind.op_names().index(reader)
    kv = ir.KvStream(k.slots, k.tokens, k.ahead, reader, caches=tuple(c.name for c in caches),
                     tile_buffers=tuple(f"{kname}_kv_{c.name}" for c in caches),
                     rows_buffer=f"{kname}_kv_rows", span=k.span, at_start=k.at_start,
                     writer=writer or "")
    width = 1
    for dim in caches[0].shape:
        width *= dim
    first = 0 if k.at_start else a
    buffers = {f"kv_{c.name}": ir.Buffer(name, "kv", (k.slots, B, k.tokens, width), "bf16",
                                         (kname, first, a), batch_axis=1, span=k.span)
               for c, name in zip(caches, kv.tile_buffers)}
    # The new token's K/V rows are written by read-modify-write of an aligned bf16 tile.
    buffers["kv_rows"] = ir.Buffer(kv.rows_buffer, "kv", (2, B, ir.SUBLANE_TILE["bf16"], width),
                                   "bf16", batch_axis=1, span=k.span)
    return kv, buffers


def _check_kv_tiles(k: KvTiles, kname: str, has_caches: bool, context: int) -> None:
    if not has_caches:
        raise fail("E-KV", f"layer kind {kname} has no KV cache to tile", k.span,
                   hint="remove the `kv tiles` line")
    sub = ir.SUBLANE_TILE["bf16"]
    if k.tokens <= 0 or k.tokens % sub:
        raise fail("E-ALIGN", f"a KV tile of {k.tokens} tokens is not a multiple of the "
                   f"{sub}-row bf16 tile", k.span,
                   hint=f"use a multiple of {sub}, e.g. {max(sub, k.tokens // sub * sub)}")
    if context % k.tokens:
        dividing = [t for t in range(sub, context + 1, sub) if context % t == 0]
        sizes = (f"tiles of {', '.join(map(str, dividing))} tokens divide it" if dividing else
                 f"no multiple of {sub} tokens divides it")
        raise fail("E-ALIGN", f"context {context} is not a whole number of {k.tokens}-token "
                   f"KV tiles", k.span,
                   hint=f"{sizes}; or make the context a multiple of {k.tokens}")
    if k.slots < 1 or k.ahead < 1:
        raise fail("E-KV", "kv tiles need at least one slot and ahead >= 1", k.span,
                   hint="e.g. `kv tiles 2 slots of 128 tokens ahead 1`")
    if context and k.ahead * k.tokens > context:
        # The first `ahead` tiles are started before the loop: each must lie inside the cache.
        raise fail("E-KV", f"kv tiles ahead {k.ahead} of {k.tokens} tokens start copies "
                   f"{k.ahead * k.tokens} positions into a cache of context {context}", k.span,
                   hint=f"ahead at most {context // k.tokens}, or smaller tiles")

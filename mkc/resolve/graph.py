"""Pass `graph`: the family's decode graph, built under the shard rules and weight formats, its
ops in the order the phases' `run OP before OP` set; a rule the model's sizes do not divide is
refused with the spellings that would, a move that would break a dependency at its line."""
from __future__ import annotations

from dataclasses import replace

from mkc.diagnostics import MkcError, fail
from mkc.layers import dense_formats
from mkc.model.family import FormatError
from mkc.lang import ast
from mkc.lang.statements.order import RunBefore
from mkc.model.graph import LayerKind, ShardingError, build_graph
from mkc.resolve.formats import format_error
from mkc.resolve.names import unknown
from mkc.resolve.sharding import group_spellings
from mkc.resolve.state import ResolveState


class IndivisibleShards(MkcError):
    """Shard rules the model's sizes do not divide on this mesh: a slice of another size may
    take them (`mkc.resolve.slices` names the smallest)."""


def resolve_graph(s: ResolveState) -> ResolveState:
    dims, family, ranks = s.dims, s.family, s.topology.num_cores
    rules = _rules(s)
    try:
        built = family.build(dims, rules, ranks, s.formats)
    except ShardingError as e:
        raise _indivisible(s, rules, e) from None
    except FormatError as e:
        raise format_error(e, s.sched) from None
    graph = build_graph(dims, replace(built, kinds=_in_phase_order(built.kinds, s.sched)), ranks)
    graph = _with_dense_formats(graph, family, s.dense_formats or {})
    ops = {o.name for k in set(graph.layer_kinds) for o in graph.kinds[k].ops}
    unlowered = sorted(ops - family.lowered_ops)
    if unlowered:        # the family's graph and lowering disagree: a family's bug, not the spec's
        raise ValueError(f"the {family.name} lowering has no compute body for ops {unlowered}")
    return replace(s, graph=graph)


def _in_phase_order(kinds: dict[str, LayerKind], sched: ast.Schedule) -> dict[str, LayerKind]:
    """The layer kinds with each phase's `run OP before OP` applied in source order (a phase of
    no layer kind of the model is left to the `layer_kinds` pass)."""
    kinds = dict(kinds)
    for phase in sched.phases:
        if phase.kind.text in kinds:
            for move in phase.run_before:
                kinds[phase.kind.text] = _moved(kinds[phase.kind.text], move)
    return kinds


def _moved(kind: LayerKind, move: RunBefore) -> LayerKind:
    """`kind` with op `move.op` run just before `move.before`: every op it passes over neither
    writes what it reads nor reads or writes what it writes."""
    names = kind.op_names()
    for n in (move.op, move.before):
        if n.text not in names:
            raise unknown(f"op of layer kind {kind.name}", n, names)
    a, b = names.index(move.op.text), names.index(move.before.text)
    if a <= b:
        raise fail("E-ORDER", f"{move.op.text} already runs before {move.before.text} in "
                   f"{kind.name}", move.span, hint="`run` moves an op earlier: drop the statement")
    moved = kind.ops[a]
    for other in kind.ops[b:a]:
        hazards = (("it reads {}, which {} writes", set(moved.reads) & set(other.writes)),
                   ("{1} reads {0}, which it writes", set(moved.writes) & set(other.reads)),
                   ("{1} writes {0} too", set(moved.writes) & set(other.writes)))
        for text, clash in hazards:
            if clash:
                raise fail("E-ORDER", f"{moved.name} cannot run before {other.name} in {kind.name}: "
                           + text.format(", ".join(sorted(clash)), other.name), move.span,
                           hint="move it only past ops it does not depend on: "
                           f"{kind.name} runs {', '.join(names)}")
    return replace(kind, ops=(*kind.ops[:b], moved, *kind.ops[b:a], *kind.ops[a + 1:]))


def _with_dense_formats(graph, family, formats: dict) -> object:
    """The graph with the matrices of each dense class the spec stores as codes retyped
    (`mkc.layers.dense_formats.apply`) and those formats among the graph's. Every class the
    family offers must have matrices in the graph (else the family's tables disagree)."""
    tensors = [t for k in set(graph.layer_kinds) for t in graph.kinds[k].tensors.values()]
    tensors += list(graph.globals.values())
    held = {t.format_class for t in tensors if t.role == "matrix"}
    empty = sorted(set(family.dense_classes) - held)
    if empty:           # the family's declaration and its graph disagree: the family's bug
        raise ValueError(f"the {family.name} family offers dense classes {empty} but its graph "
                         "has no matrix of them (`Tensor.format_class`)")
    if not formats:
        return graph
    kinds = {name: replace(k, tensors=dense_formats.apply(k.tensors, formats))
             for name, k in graph.kinds.items()}
    return replace(graph, kinds=kinds, globals=dense_formats.apply(graph.globals, formats),
                   formats={**graph.formats, **formats})


def _rules(s: ResolveState) -> dict[str, tuple[int, int]]:
    """The shard rules {class: (ways, stride)}, in the spec's order."""
    return {rule.dim.text: s.shards.rule(rule.dim.text) for rule in s.sched.shards}


def _indivisible(s: ResolveState, rules: dict[str, tuple[int, int]],
                 e: ShardingError) -> IndivisibleShards:
    spans = {rule.dim.text: rule.span for rule in s.sched.shards}
    span = spans.get(e.dim_class or "", next(iter(spans.values()), s.sched.name.span))
    ranks = s.topology.num_cores
    valid = _valid_spellings(s, e.dim_class, rules) if e.dim_class in rules else []
    hint = (f"on these {ranks} ranks, with the other rules as written, write "
            f"`shard {e.dim_class} over {valid[0]}`"
            + (f" (or over {', '.join(valid[1:])})" if valid[1:] else "")
            if valid else "choose a mesh whose size divides the model's head and width counts")
    error = fail("E-SHARD", f"cannot shard {s.dims.name} over {ranks} ranks: {e}", span,
                 hint=hint)
    return IndivisibleShards(error.diagnostics)


def _valid_spellings(s: ResolveState, cls: str, rules: dict[str, tuple[int, int]]) -> list[str]:
    """The groups `cls` could be sharded over on this mesh, other rules unchanged, for which
    the family's graph builds (only on the failure path: a build costs microseconds)."""
    valid = []
    for text, group in group_spellings(s.mesh_axis, s.topology).items():
        try:
            s.family.build(s.dims, rules | {cls: group}, s.topology.num_cores, s.formats)
        except (ShardingError, FormatError):
            continue
        valid.append((-group[0], group[1], text))
    return [text for *_, text in sorted(valid)]      # the widest split first

"""A candidate spec's text: the input's statements that the new slice changes, rewritten in
place (everything else, comments included, stays where it is)."""
from __future__ import annotations

from dataclasses import dataclass, field

from mkc import target
from mkc.lang import ast
from mkc.lang.statements.collectives import AllGather, Exchange, sibling_swap_text, written_scatter
from mkc.model.graph import FamilyGraph
from mkc.model.sharding import ShardTable
from mkc.perf.tune import SpecSource
from mkc.retarget.layout import Group, choose_algorithm, partial_classes, spell, split_classes

MIB = 1 << 20


@dataclass
class TextEdits:
    """Edits of the source by character range, applied back to front."""

    src: SpecSource
    edits: list[tuple[int, int, str]] = field(default_factory=list)

    def replace(self, span, text: str) -> None:
        a, b = self.src.span_range(span)
        if self.src.text[a:b] != text:
            self.edits.append((a, b, text))

    def insert_lines_after(self, span, texts: list[str]) -> None:
        """New statement lines after the line `span` ends on, at that line's indent."""
        line = self.src.text.split("\n")[span.end_line - 1]
        indent = line[:len(line) - len(line.lstrip())]
        end = self.src.lines[span.end_line - 1] + len(line)
        self.edits.append((end, end, "".join(f"\n{indent}{t}" for t in texts)))

    def apply(self) -> str:
        out = self.src.text
        for a, b, t in sorted(self.edits, key=lambda e: (e[0], e[1]), reverse=True):
            out = out[:a] + t + out[b:]
        return out


@dataclass(frozen=True)
class Plan:
    """What a candidate changes: the slice, the schedule's name, the rules (class -> group and
    its spelling), whether all-reduces over hosts switch to two levels, the VMEM setting."""

    gen: str
    topo: target.Topology
    name: str
    rules: dict[str, Group]
    spelled: dict[str, str]
    by_span: bool
    vmem: tuple[int, int]          # limit, reserve in bytes


def size_text(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes % MIB == 0 else f"{nbytes >> 10} KiB"


def header_edits(ed: TextEdits, sched: ast.Schedule, plan: Plan) -> None:
    """The schedule's name, target, mesh and VMEM lines."""
    s = sched.settings
    ed.replace(sched.name.span, plan.name)
    ed.replace(s["target"].span, f"target  {plan.gen} topology {plan.topo.shape}")
    axis = s["mesh"].value[0].text
    ed.replace(s["mesh"].span, f"mesh    {axis} = {plan.topo.num_cores}")
    limit, reserve = plan.vmem
    ed.replace(s["vmem"].span, f"vmem    limit {size_text(limit)} reserve {size_text(reserve)}")


def shard_edits(ed: TextEdits, sched: ast.Schedule, plan: Plan) -> None:
    for rule in sched.shards:
        ed.replace(rule.span, f"shard {rule.dim.text} over {plan.spelled[rule.dim.text]}")


def collective_edits(ed: TextEdits, sched: ast.Schedule, plan: Plan, graph: FamilyGraph,
                     axis: str) -> None:
    """Each phase's all-reduce algorithms and gather lines under the plan's rules. A line keeps
    its `scatter` and `overlap` clauses (a scatter pads its chunks to whole lane tiles)."""
    table = ShardTable.of(plan.rules, plan.topo.num_cores)
    for phase in sched.phases:
        kind = graph.kinds.get(phase.kind.text)
        if kind is None:
            continue                       # the check reports a phase of no layer kind
        partial = partial_classes(kind)
        for ar in phase.allreduces:
            over = {o.text: table.reduction_group(partial[o.text]) for o in ar.ops if o.text in partial}
            written = f"{ar.algorithm.text} {ar.level.text}" if ar.level else ar.algorithm.text
            algorithm = choose_algorithm(written, list(over.values()), plan.topo, plan.by_span)
            if algorithm != written:
                ops = ", ".join(o.text for o in ar.ops)
                ed.replace(ar.span, f"allreduce {ops} {algorithm} wire {ar.wire_dtype.text}"
                           + written_scatter(ar.scatter, 1 if algorithm == "direct" else 2)
                           + (" overlap" if ar.overlap else ""))
        _gather_edits(ed, phase, split_classes(kind), plan, axis)


def _gather_form(op: str, cls: str, line: AllGather | Exchange, plan: Plan,
                 axis: str) -> str:
    """The statement that gathers `op` (`{}` for its op list): as written if it still gathers
    over the rule's group, a swap with the sibling core where the group is a chip's cores and
    the line swapped, else an allgather over the rule's spelling."""
    group, cores = plan.rules[cls], plan.topo.chip.cores_per_chip
    sibling = cores > 1 and group == (cores, 1)
    if isinstance(line, Exchange) and sibling:
        return sibling_swap_text(line.wire_dtype.text)
    return "allgather {} over " + plan.spelled.get(cls, spell(group, axis, plan.topo))


def _gather_edits(ed: TextEdits, phase: ast.Phase, split: dict[str, str], plan: Plan,
                  axis: str) -> None:
    """Rewrite a gather line whose ops now want another statement; ops wanting different
    statements are split over lines (the first in place, the others after it)."""
    for line in sorted(phase.allgathers + phase.exchanges, key=lambda x: x.span.line):
        forms: dict[str, list[str]] = {}
        for o in line.ops:
            if o.text in split:
                forms.setdefault(_gather_form(o.text, split[o.text], line, plan, axis),
                                 []).append(o.text)
        # an allgather keeps its `overlap` (an exchange has none)
        overlap = " overlap" if getattr(line, "overlap", None) else ""
        texts = [form.format(", ".join(ops)) + (overlap if form.startswith("allgather") else "")
                 for form, ops in forms.items()]
        if not texts:
            continue                       # nothing to gather: the check says so
        ed.replace(line.span, texts[0])
        if texts[1:]:
            ed.insert_lines_after(line.span, texts[1:])


def format_edits(text: str, sched: ast.Schedule, gen: str) -> str:
    """The spec's `format` lines on generation `gen`: a format whose values the new target's
    MXU does not take as they are (FP4 off tpu7x, `mkc.target.Generation.fp4_operand`) becomes
    its fallback with the same block (`fp8 block N`: exact while a block's 32-row scales span
    at most 8 octaves, which packing checks), and `rounded` (with its `scale`), which only FP4
    takes, goes."""
    from mkc.resolve.formats import FALLBACK, NATIVE
    g = target.generation(gen)
    ed = TextEdits(SpecSource(text))
    for f in sched.formats:
        native = NATIVE.get(f.format.text)
        if native is None or getattr(g, native) or f.format.text not in FALLBACK:
            continue
        ed.replace(f.format.span, FALLBACK[f.format.text])
        if f.rounded is not None:         # `rounded [scale S]`: the clause goes whole
            a, b = ed.src.span_range(f.rounded.span)
            b = ed.src.span_range(f.scale.span)[1] if f.scale is not None else b
            ed.edits.append((a - 1 if ed.src.text[a - 1] == " " else a, b, ""))
    return ed.apply()

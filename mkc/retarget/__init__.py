"""`mkc retarget SPEC --target 'GEN topology GRID' -o OUT`: a checked spec for another slice.

The new slice fixes the target and the mesh (every rank). From the model's sizes and the slice
the retarget derives the rest (`mkc.retarget.layout`): shard rules the family builds under
(the spec's own carried over first, then the widest that build), each phase's all-reduce
algorithms and gathers under those rules (a swap with the sibling core only where a chip
has two cores), the VMEM limit (the generation's, where the spec used its chip's whole VMEM) and
reserve, and what VMEM forces smaller (`mkc.retarget.fit`). The candidates, a few: the spec's
rules carried over, the widest rules, each with all-reduces over hosts made two-level. Each
is checked like `mkc check`; of those that pass, the shortest modelled step (mean over the
spec's smallest and largest batch, `mkc.perf`) is written. Retargeting a spec to its own
slice keeps its layout: the one candidate is the spec itself.

Only the statements that change are rewritten; a comment they own that states numbers is
dropped (`mkc.perf.comments`), and the header comment is replaced by one that says where
the spec came from and its modelled step. When no candidate passes, one diagnostic at the
spec's target line says why (HBM short by how much, rules that divide nowhere, VMEM) and
names the nearest slice of the generation where the retarget works.
"""
from __future__ import annotations

import difflib
import math
import re
import textwrap
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from mkc import target
from mkc.diagnostics import Diagnostic, MkcError, Span, fail
from mkc.lang import ast
from mkc.lang.fmt import format_text
from mkc.lang.parser import parse, parse_topology
from mkc.model.graph import FamilyGraph, ShardingError
from mkc.perf.comments import drop_stale_comments
from mkc.perf.tune import SpecSource
from mkc.resolve.driver import run
from mkc.resolve.state import ResolveState
from mkc.retarget.comments import drop_old_figures
from mkc.retarget.edit import (MIB, Plan, TextEdits, collective_edits, format_edits, header_edits,
                               shard_edits)
from mkc.retarget.fit import Checked, check, fit
from mkc.retarget.layout import Builder, carried_over, mesh_groups, search_rules, spell, spelling

_TARGET = re.compile(r"^\s*([A-Za-z0-9_]+)\s+topology\s+([0-9]+(?:x[0-9]+)*)\s*$")
MAX_NEAREST = 6         # slices tried when naming the nearest that works


@dataclass(frozen=True)
class Slice:
    gen: str
    dims: tuple[int, ...]

    @property
    def shape(self) -> str:
        return "x".join(map(str, self.dims))

    def __str__(self) -> str:
        return f"{self.gen} topology {self.shape}"


def parse_target(text: str) -> Slice:
    """`GEN topology GRID` as a spec writes it, for a slice libtpu lays out; else E-TARGET."""
    where = Span.unknown("--target")
    m = _TARGET.match(text)
    if m is None:
        raise fail("E-TARGET", f"--target '{text}' is not a slice", where,
                   hint="write it as a spec's target line does: 'v6e topology 4x8'")
    gen, dims = m.group(1), parse_topology(m.group(2), where)
    if gen not in target.known_chips():
        why = (target.generation(gen).unsupported if gen in target.all_generations()
               else "unknown generation")
        raise fail("E-TARGET", f"--target generation '{gen}': {why}", where,
                   hint=f"generations mkc compiles for: {', '.join(target.known_chips())}")
    try:
        target.topology(gen, dims)
    except target.TargetError as e:
        raise fail("E-TARGET", e.message, where, hint=e.hint) from None
    return Slice(gen, dims)


def spec_slice(sched: ast.Schedule) -> Slice:
    gen, (_, dims) = sched.settings["target"].value
    return Slice(gen.text, tuple(dims))


@dataclass
class RetargetResult:
    spec: str
    source: Slice
    new: Slice
    text: str                      # the spec written
    before: Checked | None         # the input on its own slice, modelled (None: it fails there)
    after: Checked                 # the candidate written, modelled
    label: str                     # which candidate it is
    tried: list[tuple[str, str]]   # (candidate, verdict) for each candidate considered
    seconds: float
    original: str = ""
    advice: list[str] = field(default_factory=list)   # what to run next (`mkc tune`)

    def diff(self) -> str:
        return "".join(difflib.unified_diff(
            self.original.splitlines(keepends=True), self.text.splitlines(keepends=True),
            self.spec, f"{self.spec} retargeted to {self.new}"))


@dataclass
class _Attempt:
    """A slice's candidates as checked: the ones that passed, every failure, and a verdict
    for each candidate considered, checked or not (numbered as `candidate i of n`)."""

    passed: list[tuple[str, Checked]] = field(default_factory=list)
    failed: list[tuple[str, Diagnostic]] = field(default_factory=list)
    refused: ShardingError | None = None
    verdicts: list[tuple[str, str]] = field(default_factory=list)   # (candidate, verdict)


def retarget(text: str, file: str, new_target: str, model: str | None = None,
             name: str | None = None, max_models: int = 3,
             progress: Callable[[str], None] | None = None, before: Checked | None = None,
             name_nearest: bool = True) -> RetargetResult:
    """The retargeted spec (module docstring); MkcError with one diagnostic if none fits.
    `before` is the input as checked and modelled, if the caller has it; `name_nearest`
    searches for the nearest slice that works when none fits (a few more checks)."""
    t0 = time.perf_counter()
    log = progress or (lambda _: None)
    new = parse_target(new_target)
    canonical = format_text(text, file)
    sched = parse(canonical, file)
    if before is None:
        before = _before(canonical, file, model, sched, log)
    if (moved := format_edits(canonical, sched, new.gen)) != canonical:
        log(f"{new.gen} takes no FP4 operand: its `format` lines become FP8 blocks")
        canonical = format_text(moved, file)
        sched = parse(canonical, file)
    name = name or default_name(sched.name.text, new)
    attempt = candidates(sched, canonical, file, model, new, name, max_models, log)
    if not attempt.passed:
        raise no_layout(sched, canonical, file, model, new, attempt,
                        log if name_nearest else None)
    label, best = min(attempt.passed, key=lambda lc: lc[1].objective)   # unmodelled: inf
    final = finish(canonical, best, file, model, sched, new, before)
    return RetargetResult(file, spec_slice(sched), new, final.text, before, final, label,
                          attempt.verdicts, time.perf_counter() - t0, text,
                          advice=vmem_advice(spec_chip(sched), target.chip(new.gen), new))


def vmem_advice(old: target.Chip, chip: target.Chip, new: Slice) -> list[str]:
    """What to run next when the new chip has more VMEM than the spec was sized for: the
    retarget only shrinks what does not fit, so rings and tiles stay the old chip's size."""
    if chip.vmem_bytes <= old.vmem_bytes:
        return []
    return [f"{new.gen} has {chip.vmem_bytes / MIB:.0f} MiB of VMEM a core, {old.name} "
            f"{old.vmem_bytes / MIB:.0f} MiB: the rings, tiles and slots are still sized for "
            f"{old.name}; run `mkc tune` on the written spec to use the rest"]


def _before(text: str, file: str, model: str | None, sched: ast.Schedule,
            log: Callable[[str], None]) -> Checked | None:
    """The input on its own slice, modelled; None where it does not pass there (a spec whose
    target line was edited by hand, say: retargeting it is what fixes it)."""
    log(f"checking {file} on {spec_slice(sched)}")
    try:
        before = Checked(text, *check(text, file, model))
    except MkcError as e:
        log(f"{file} does not pass on {spec_slice(sched)} ({e.diagnostics[0].code}): no "
            "modelled step before")
        return None
    before.model()
    return before


def default_name(old: str, new: Slice) -> str:
    return f"{old}_{new.gen}_{new.shape}"


def new_state(sched: ast.Schedule, new: Slice, model: str | None) -> ResolveState:
    """Resolve's state through the `formats` pass on the new slice (every class over the
    mesh axis, which always names a group): dims, family, formats and the topology."""
    tgt, mesh = sched.settings["target"], sched.settings["mesh"]
    topo = target.topology(new.gen, new.dims)
    axis = mesh.value[0]
    settings = dict(sched.settings)
    settings["target"] = ast.Setting((ast.Name(new.gen, tgt.span),
                                      (ast.Name(new.shape, tgt.span), new.dims)), tgt.span)
    settings["mesh"] = ast.Setting((axis, topo.num_cores), mesh.span)
    vmem = sched.settings["vmem"]
    settings["vmem"] = ast.Setting(tuple(ast.Setting(v, x.span) for v, x in zip(
        vmem_setting(sched, topo.chip, spec_chip(sched)), vmem.value)), vmem.span)
    shards = [replace(r, group=ast.Group(ast.Name(axis.text, r.span), span=r.span))
              for r in sched.shards]
    return run(replace(sched, settings=settings, lists={**sched.lists, "shards": shards}), model,
               after="formats")


def plans(sched: ast.Schedule, st: ResolveState, new: Slice, name: str, same: bool
          ) -> tuple[list[tuple[str, Plan, FamilyGraph]], list[tuple[str, ShardingError]]]:
    """The candidate layouts (module docstring), and each layout whose rules the family
    refuses, with its refusal."""
    topo, axis = st.topology, st.mesh_axis
    builder = Builder(st)
    written = {r.dim.text: r.group for r in sched.shards}
    every = mesh_groups(topo.num_cores)
    carried = {c: carried_over(g, axis, topo) for c, g in written.items()}
    layouts = [("the spec's rules", search_rules(
        builder, {c: g or every[0] for c, g in carried.items()},
        {c: ([g] if g else []) + every for c, g in carried.items()}))]
    if not same:
        layouts.append(("the widest rules", search_rules(
            builder, {c: every[0] for c in written}, {c: every for c in written})))
    good = [(label, rules) for label, rules in layouts if not isinstance(rules, ShardingError)]
    refused = [(label, rules) for label, rules in layouts if isinstance(rules, ShardingError)]
    vmem = vmem_setting(sched, st.topology.chip, spec_chip(sched))
    out = []
    for label, rules in good:
        spelled = {c: spell(g, axis, topo, spelling(written[c])) for c, g in rules.items()}
        graph = builder.graph(rules)
        for by_span in ((False,) if same else (False, True)):
            out.append((label + (", all-reduces over hosts in two levels" if by_span else ""),
                        Plan(new.gen, topo, name, rules, spelled, by_span, vmem), graph))
    return out, refused


def spec_chip(sched: ast.Schedule) -> target.Chip:
    return target.chip(spec_slice(sched).gen)


def vmem_setting(sched: ast.Schedule, chip: target.Chip, old: target.Chip) -> tuple[int, int]:
    """The VMEM limit (the new chip's whole VMEM where the spec used its chip's whole VMEM,
    else the spec's, capped to the chip's) and reserve (the spec's, scaled down with a smaller
    limit, at least 1 MiB)."""
    limit, reserve = (x.value for x in sched.settings["vmem"].value)
    new_limit = chip.vmem_bytes if limit >= old.vmem_bytes else min(limit, chip.vmem_bytes)
    if new_limit < limit:
        reserve = max(1 << 20, round(reserve * new_limit / limit / (1 << 20)) << 20)
    return new_limit, reserve


def candidate_text(text: str, sched: ast.Schedule, plan: Plan, graph: FamilyGraph) -> str:
    ed = TextEdits(SpecSource(text))
    header_edits(ed, sched, plan)
    shard_edits(ed, sched, plan)
    collective_edits(ed, sched, plan, graph, sched.settings["mesh"].value[0].text)
    return format_text(ed.apply(), sched.source_file)


def candidates(sched: ast.Schedule, text: str, file: str, model: str | None, new: Slice,
               name: str, max_models: int, log: Callable[[str], None],
               first_only: bool = False) -> _Attempt:
    """Every candidate checked (and fitted to VMEM), or up to the first that passes; the first
    `max_models` that pass are modelled. Each candidate gets a verdict, the ones not checked
    too: the same text as an earlier one, rules the family refuses, one passed already."""
    attempt = _Attempt()
    same = new == spec_slice(sched)
    try:
        st = new_state(sched, new, model)
    except MkcError as e:
        attempt.failed.append(("the spec on the new slice", e.diagnostics[0]))
        return attempt
    found, refused = plans(sched, st, new, name, same)
    if not found:
        attempt.refused = refused[0][1]
    total = len(found) + len(refused)

    def verdict(i: int, label: str, text: str) -> None:
        attempt.verdicts.append((f"{i} of {total}, {label}", text))
        log(f"candidate {i} of {total} on {new}: {label}: {text}")

    seen: dict[str, tuple[int, Plan]] = {}        # text -> the first candidate giving it
    passed_at: int | None = None
    for i, (label, plan, graph) in enumerate(found, start=1):
        if first_only and passed_at is not None:
            verdict(i, label, f"not checked: candidate {passed_at} passes")
            continue
        cand = candidate_text(text, sched, plan, graph)
        if cand in seen:
            j, first = seen[cand]
            verdict(i, label, f"skipped: {_same_as(plan, first)}, so it is candidate {j}'s spec")
            continue
        seen[cand] = (i, plan)
        log(f"candidate {i} of {total} on {new}: {label}: checking")
        try:
            checked = fit(cand, file, model)
        except MkcError as e:
            attempt.failed.append((label, e.diagnostics[0]))
            verdict(i, label, f"fails {e.diagnostics[0].code}: {e.diagnostics[0].message}")
            continue
        if len(attempt.passed) < max_models:
            checked.model()
        attempt.passed.append((label, checked))
        passed_at = i
        verdict(i, label, "passes: " + _steps_text(checked, max_models))
    for i, (label, why) in enumerate(refused, start=len(found) + 1):
        verdict(i, label, f"skipped: no shard rules of this kind build ({why})")
    return attempt


def _same_as(plan: Plan, first: Plan) -> str:
    """Why a candidate's text is an earlier one's."""
    if plan.rules == first.rules and plan.by_span != first.by_span:
        return "no all-reduce goes over hosts on this slice"
    if plan.rules == first.rules:
        return "its shard rules come out as the earlier candidate's"
    return "its rules are written as the earlier candidate's"


def _steps_text(c: Checked, max_models: int) -> str:
    if not c.steps:
        return f"not modelled (only the first {max_models} that pass are: --models)"
    counted = "; ".join(f"B{b}: {why}" for b, why in c.counted.items())
    return (", ".join(f"B{b} {t * 1e3:.3f} ms" for b, t in c.steps.items()) + " (modelled"
            + (f"; COUNTED in part, not compiled: {counted}" if counted else "") + ")")


def finish(original: str, best: Checked, file: str, model: str | None, sched: ast.Schedule,
           new: Slice, before: Checked | None) -> Checked:
    """The chosen candidate with its changed statements' stale comments dropped and the
    provenance note at the schedule line, checked again (comments only changed)."""
    old_lines, new_lines = original.split("\n"), best.text.split("\n")
    changed: dict[int, str | None] = {}
    sm = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    for op, _, _, j1, j2 in sm.get_opcodes():
        if op != "equal":
            changed.update({j: None for j in range(j1 + 1, max(j2, j1 + 1) + 1)})
    if new != spec_slice(sched):
        # A collective's groups are the slice's, its text unchanged or not: a comment of it
        # that counts peers or hosts counted the old slice's.
        changed.update({x.span.line: None for p in parse(best.text, file).phases
                        for x in p.allreduces + p.allgathers + p.exchanges})
    header = next(i + 1 for i, line in enumerate(new_lines) if line.startswith("schedule "))
    changed[header] = note(sched, new, before, best)
    text = drop_stale_comments(best.text, changed)
    if new != spec_slice(sched):
        # the kept comments' figures (bytes, step times) were the old slice's
        header = next(i + 1 for i, line in enumerate(text.split("\n"))
                      if line.startswith("schedule "))
        text = drop_old_figures(text, keep_above=header)
    text = format_text(text, file)
    return Checked(text, *check(text, file, model), best.notes, best.steps)


def note(sched: ast.Schedule, new: Slice, before: Checked | None, after: Checked) -> str:
    """The header comment of a retargeted spec (the tool's own numbers, labelled modelled)."""
    was = before.steps if before else {}
    steps = "; ".join(f"batch {b} " + (f"{was[b] * 1e3:.3f} -> " if b in was else "")
                      + f"{t * 1e3:.3f} ms" for b, t in after.steps.items())
    text = (f"{sched.name.text} retargeted by `mkc retarget` from {spec_slice(sched)} to {new} "
            f"({after.ir.ranks} ranks). Modelled step: {steps}."
            + "".join(f" {n}." for n in after.notes))
    return "\n".join("# " + line for line in textwrap.wrap(text, 94))


def no_layout(sched: ast.Schedule, text: str, file: str, model: str | None, new: Slice,
              attempt: _Attempt, log: Callable[[str], None] | None) -> MkcError:
    """The one diagnostic: why no candidate fits, and the nearest slice that works (unless
    `log` is None: no search)."""
    why, bigger = _why(sched, text, file, model, new, attempt)
    if log is None:
        return fail("E-RETARGET", f"cannot retarget {sched.name.text} to {new}: {why}",
                    sched.settings["target"].span)
    found = nearest_slice(sched, text, file, model, new, bigger, log)
    hint = (f"the nearest slice that works: `{found}`" if found else
            f"no {new.gen} slice near {new.shape} works either")
    return fail("E-RETARGET", f"cannot retarget {sched.name.text} to {new}: {why}",
                sched.settings["target"].span, hint=hint)


def _why(sched: ast.Schedule, text: str, file: str, model: str | None, new: Slice,
         attempt: _Attempt) -> tuple[str, bool]:
    """The reason, and whether only bigger slices can help (HBM)."""
    if attempt.refused is not None:
        return f"no shard rules build on its {target.topology(new.gen, new.dims).num_cores} " \
               f"ranks ({attempt.refused})", False
    hbm = [d for _, d in attempt.failed if d.code == "E-HBM-CAPACITY"]
    if hbm and len(hbm) == len(attempt.failed):
        return _hbm_short(hbm[0], sched, new), True
    d = next((d for _, d in attempt.failed if d.code != "E-HBM-CAPACITY"), attempt.failed[0][1])
    return f"{d.message} ({d.code})", False


def _hbm_short(d: Diagnostic, sched: ast.Schedule, new: Slice) -> str:
    m = re.search(r"needs ([\d.]+) GB of HBM but has ([\d.]+) GB", d.message)
    if m is None:
        return d.message
    need, has = float(m.group(1)), float(m.group(2))
    return (f"HBM short by {(need - has) * 1e9 / 2**30:.1f} GiB a chip ({need:.1f} GB needed, "
            f"{has:.1f} GB on a {new.gen} chip)")


def nearest_slice(sched: ast.Schedule, text: str, file: str, model: str | None, new: Slice,
                  bigger: bool, log: Callable[[str], None]) -> str | None:
    """The standard slice of the generation nearest in chips to `new` (bigger ones first on a
    tie, only bigger ones when HBM is short) on which a candidate passes; bounded."""
    chips = math.prod(new.dims)
    shapes = [Slice(new.gen, tuple(int(d) for d in s.split("x")))
              for s in target.standard_shapes(new.gen)]
    shapes = [s for s in shapes if s != new and (not bigger or math.prod(s.dims) > chips)]
    shapes.sort(key=lambda s: (abs(math.log2(math.prod(s.dims) / chips)), -math.prod(s.dims)))
    for s in shapes[:MAX_NEAREST]:
        attempt = candidates(sched, text, file, model, s, default_name(sched.name.text, s), 0,
                             lambda m: log(f"nearest slice: {m}"), first_only=True)
        if attempt.passed:
            return str(s)
    return None


# Candidates are new layouts: each is priced as `mkc perf` prices it, per op.
PRICED_BY = ("compiled per op where it can be: each op body of a candidate's kernel by its "
             "measure (shipped, cached, or compiled alone; mkc.perf.op_measures), collectives "
             "counted; an op nothing can compile (no libtpu) is counted (mkc.perf.work); "
             "`mkc perf --compiled OUT` prices the written spec by its whole kernel")


def summary(res: RetargetResult) -> str:
    """Every candidate considered with its verdict, which was written and why, the modelled
    step before and after per batch, and what to run next."""
    modelled = [v for _, v in res.tried if v.startswith("passes: B")]
    why = (f"the shortest modelled step of the {len(modelled)} modelled"
           if len(modelled) > 1 else "the one that passes" if len(modelled) == 1 else
           "the first that passes")
    lines = [f"mkc retarget {res.spec}: {res.source} -> {res.new} in {res.seconds:.1f} s; "
             f"written: {res.label}, {why} (times are modelled, not measured)"]
    lines.append(f"  priced: {PRICED_BY}")
    lines += [f"  candidate {label}: {verdict}" for label, verdict in res.tried]
    lines += [f"  {n}" for n in res.after.notes]
    lines.append(f"  {'batch':>5} {'before ms':>10} {'after ms':>10}")
    for b, t in res.after.steps.items():
        was = res.before.steps.get(b) if res.before else None
        lines.append(f"  {b:>5} {was * 1e3 if was else float('nan'):10.3f} {t * 1e3:10.3f}")
    lines += [f"next: {a}" for a in res.advice]
    return "\n".join(lines)


def result_json(res: RetargetResult) -> dict:
    return {"modelled": True, "priced_by": PRICED_BY,
            "from": str(res.source), "to": str(res.new), "chosen": res.label,
            "candidates": [{"candidate": c, "verdict": v} for c, v in res.tried],
            "notes": res.after.notes, "advice": res.advice, "seconds": res.seconds,
            "before_step_seconds": {str(b): t for b, t in
                                    (res.before.steps if res.before else {}).items()},
            "after_step_seconds": {str(b): t for b, t in res.after.steps.items()},
            "diff": res.diff()}

"""Checking a candidate, and making it fit VMEM where the new slice leaves it short.

A candidate that fails only on VMEM capacity is shrunk one step at a time, each step where
the kernel's bytes are: the buffer class holding the most bytes at the widest kernel loses
one unit of its own setting (a ring slot while it has more than 4, then half its tile bound's
longer side, then slots down to 2; an expert slot; a KV tile slot; an all-reduce over hosts
goes two levels, its receive buffer one per host instead of one per rank). A step that
does not shrink its class is undone and the next class is tried. When no class has a setting
left, the verify step's sequences, then the batch range, then the verify rows are shrunk:
each a note of the retarget, as every step is. The steps are bounded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mkc import ir
from mkc.checks import run_checks
from mkc.diagnostics import MkcError
from mkc.lang.parser import parse
from mkc.perf import tune
from mkc.perf.run import kernel_measure, step_model
from mkc.resolve import resolve
from mkc.retarget.edit import TextEdits

MAX_SHRINKS = 24


@dataclass
class Checked:
    """A candidate that passed every check, its modelled step per batch and how it was fitted."""

    text: str
    ir: ir.ScheduleIR
    events: list
    notes: list[str] = field(default_factory=list)
    steps: dict[int, float] = field(default_factory=dict)
    # batch -> why its kernel (or some of its ops) is counted rather than priced compiled
    counted: dict[int, str] = field(default_factory=dict)

    @property
    def objective(self) -> float:
        return sum(self.steps.values()) / len(self.steps) if self.steps else float("inf")

    def model(self) -> None:
        s = self.ir
        # priced as `mkc perf` prices it: compiled per op (each op body measured or compiled
        # alone), counted only where nothing compiles
        self.steps, self.counted = {}, {}
        for b in sorted({s.batch_min, s.batch_max}):
            m, why = kernel_measure(s, b)
            self.steps[b] = step_model(s, b, s.context, keep_timeline=False, compiled=m).step_s
            ops = (m or {}).get("op_level", {}).get("ops_counted", {})
            if m is None or ops:
                self.counted[b] = why if m is None else f"{', '.join(sorted(ops))} counted"


def check(text: str, file: str, model: str | None) -> tuple[ir.ScheduleIR, list]:
    s = resolve(parse(text, file), model)
    return s, run_checks(s)


def fit(text: str, file: str, model: str | None) -> Checked:
    """The candidate as checked, shrunk until it fits VMEM; the MkcError of the last attempt
    when it cannot be made to pass."""
    changes: dict[str, list[str]] = {}    # setting -> [first value, last value]
    tried: set[str] = set()
    for _ in range(MAX_SHRINKS):
        try:
            s, events = check(text, file, model)
            break
        except MkcError as e:
            if not _short_of_vmem(e, text, file, model):
                raise
            step = _shrink(text, file, model, tried)
            if step is None:
                raise
            text, setting, old, new = step
            changes.setdefault(setting, [old, new])[1] = new
    else:
        s, events = check(text, file, model)
    notes = [f"VMEM: {setting} {old} -> {new}" for setting, (old, new) in changes.items()]
    return Checked(text, s, events, notes)


def _short_of_vmem(e: MkcError, text: str, file: str, model: str | None) -> bool:
    """Every diagnostic says the kernel needs less VMEM: over the budget, or under the headroom
    the spec's own `expect vmem headroom` promises (a promise kept on the new target too)."""
    s = resolve(parse(text, file), model)
    promised = {x.span for x in s.expectations if x.resource == "vmem"}
    return all(d.code == "E-VMEM-CAPACITY" or (d.code == "E-EXPECT" and d.span in promised)
               for d in e.diagnostics)


def class_bytes(s: ir.ScheduleIR) -> dict[str, int]:
    """VMEM bytes of the kernel's buffers by class at its widest kernel (scopes ignored)."""
    out: dict[str, int] = {}
    for b in s.buffers:
        if b.exists_at(s.rows_max):
            out[b.cls] = out.get(b.cls, 0) + b.at_batch(s.rows_max).vmem_bytes
    return out


def _shrink(text: str, file: str, model: str | None, tried: set[str]
            ) -> tuple[str, str, str, str] | None:
    """One step (module docstring): the new text, the setting, its old and new value; None
    when nothing is left to shrink."""
    sched = parse(text, file)
    s = resolve(sched, model)
    knobs = tune.find_knobs(sched, tune.SpecSource(text), s)
    before = class_bytes(s)
    for cls in sorted(before, key=lambda c: -before[c]):
        for knob, value in _class_steps(cls, knobs):
            cand = tune.render(text, knobs, tuple(value if k is knob else k.value for k in knobs))
            key = f"{knob.name}={value}"
            if key in tried:
                continue
            tried.add(key)
            try:
                after = class_bytes(resolve(parse(cand, file), model))
            except MkcError:
                continue         # e.g. two levels over hosts where an op's group has one
            if after.get(cls, 0) < before[cls]:
                return cand, knob.name, knob.show(knob.value), knob.show(value)
    return _shrink_rows(sched, text)


def _class_steps(cls: str, knobs: list[tune.Knob]) -> list[tuple[tune.Knob, tuple]]:
    """The one-unit shrinks of the settings that size buffers of class `cls`, in the order to
    try them (the ring: slots while more than 4, then its tile bound, then slots to 2)."""
    out: list[tuple[int, tune.Knob, tuple]] = []
    for k in knobs:
        v = k.value
        if cls == "ring" and k.name.endswith("slots / stream ahead") and v[0] > 2:
            out.append((0 if v[0] > 4 else 2, k, (v[0] - 1, min(v[1], v[0] - 1))))
        elif cls == "ring" and k.name.endswith(" slots") and v[0] > 2:
            out.append((0 if v[0] > 4 else 2, k, (v[0] - 1,)))
        elif cls == "ring" and k.name.endswith("tile bound") and max(v) >= 256:
            longer = 0 if v[0] >= v[1] else 1       # halved: a multiple of 128 stays one
            out.append((1, k, tuple(x // 2 if i == longer else x for i, x in enumerate(v))))
        elif cls == "pool" and k.name.startswith("pool ") and v[0] > 1:
            out.append((0, k, (v[0] - 1,)))
        elif cls == "kv" and k.name.startswith("kv tiles") and v[0] > 1:
            out.append((0, k, (v[0] - 1, v[1], min(v[2], v[0] - 1))))
        elif cls == "collective" and k.name.startswith("allreduce") \
                and ("two_level host", v[1]) in k.neighbours(v) and v[0] != "two_level host":
            out.append((0, k, ("two_level host", v[1])))
    return [(k, v) for _, k, v in sorted(out, key=lambda t: t[0])]


def _shrink_rows(sched, text: str) -> tuple[str, str, str, str] | None:
    """The last resort: fewer verify sequences, then half the batch range's top, then half
    the verify rows (each changes what the kernel serves)."""
    ed = TextEdits(tune.SpecSource(text))
    batch, verify = sched.settings["batch"], sched.settings.get("verify")
    lo, hi = batch.value
    if verify is not None:
        rows, (vlo, vhi) = verify.value
        if vhi > vlo:
            ed.replace(verify.span, _verify_text(rows, vlo, vhi - 1))
            return ed.apply(), "verify sequences", f"{vlo} to {vhi}", f"{vlo} to {vhi - 1}"
    if hi > lo:
        new = max(lo, hi // 2)
        ed.replace(batch.span, f"batch   {lo} to {new}")
        return ed.apply(), "batch (the kernel serves fewer rows)", f"{lo} to {hi}", \
            f"{lo} to {new}"
    if verify is not None and verify.value[0] > 2:
        rows, (vlo, vhi) = verify.value
        ed.replace(verify.span, _verify_text(rows // 2, vlo, vhi))
        return ed.apply(), "verify rows (fewer drafts per launch)", str(rows), str(rows // 2)
    return None


def _verify_text(rows: int, lo: int, hi: int) -> str:
    if (lo, hi) == (1, 1):
        return f"verify  {rows}"
    return f"verify  {rows} sequences {lo} to {hi}" if lo != hi else \
        f"verify  {rows} sequences {lo}"

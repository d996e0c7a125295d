"""What libtpu makes of the kernel mkc emits, per op: the kernel compiled (compile-only, for the
spec's topology), its final LLO read (`mkc.perf.llo`) and every bundle charged to the op, the
collective, the copy or the kernel statement it was lowered from.

The compile runs with libtpu's source annotations and with mkc's own files excluded from JAX's
source locations (`mkc.confirm.LOCATE_IN_MODULE`), so an instruction's location is the line of
the generated module that called into mkc: an op's call (`lower.in_proj(c, h)`), a collective
(`k.allreduce(...)  # spec line 47`), a copy, or the kernel's own statements (the entry
barrier, the ring's fill, the layer loop). Those lines are read from the module's AST. An
instruction libtpu left without a location (MXU pushes of a matmul, spill code) is charged to
the located instruction before it in program order. A bundle issues in one cycle of the static
schedule: its cycle is shared among the rows of its instructions.

Per row: its bundles as compiled (each loop body once), and its cycles per call with every loop
inside it whose trip count is a constant expanded (`llo.Loop.trips`); a loop whose count is
decided at run time (the routed experts, the KV tiles) is reported per iteration. Slot use is
counted the same way; the bound is the slot kind closest to its capacity (the most a bundle of
this kernel issues), or the dependency chain when no unit is half busy.

Results are cached by the kernel the module traces to, the rows its lines are charged to, kernel,
rows and the JAX and libtpu versions (`cache_key`): the shipped specs'
in `mkc/perf/data/bundles/` (`benchmarks/bundles.py` writes them), others in the user's cache.
"""
from __future__ import annotations

import ast
import bisect
import hashlib
import json
import os
import re
import tempfile
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from mkc import ir
from mkc.perf import llo

DATA = Path(__file__).parent / "data" / "bundles"
SCHEMA = 6                    # what a measure holds: raise it when the reading of the LLO changes
HOTTEST_BUNDLES = 12          # bundles of an op's hottest region kept for the report
HOTTEST_TEXT = 240            # characters of each
KEEP = 12                     # measures kept per spec name
_DUMP = ("--xla_jf_dump_to={0} --xla_jf_dump_llo_text=true "
         "--xla_mosaic_enable_llo_source_annotations=true")
# Calls of the kernel object (`k.`) and a layer (`c.`) that move data rather than compute.
_COLLECTIVES = {"allreduce": "all-reduce", "allgather": "all-gather", "exchange": "exchange"}
_COPIES = frozenset({"copy", "start_experts", "wait_pooled", "prefetch_view", "start_view",
                     "vectors_arrive", "start", "wait"})
_KERNEL_CALLS = {"enter": "entry barrier", "fill": "prologue copies", "run_layers": "layer loop",
                 "layer": "layer setup", "run_scoped": "scoped allocation"}
_SPEC_LINE = re.compile(r"#\s*spec line (\d+)")


class BundleError(Exception):
    """A bundle report that cannot be made (no libtpu for the generation, a failed compile);
    `setting` names the spec setting at fault, if one is."""

    def __init__(self, message: str, setting: str = "target") -> None:
        super().__init__(message)
        self.setting = setting


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return ""


def libtpu_version() -> str:
    return _version("libtpu")


@dataclass(frozen=True)
class Label:
    """What a line of the generated module runs: an op of a layer kind, a collective, copies or
    the kernel's own statements."""

    group: str                   # "op" | "collective" | "copies" | "kernel"
    kind: str                    # layer kind, "tail", or "" (kernel)
    name: str                    # op name, collective, or the kernel statement
    spec_line: int = 0

    @property
    def key(self) -> str:
        if self.group == "op":
            return f"{self.kind}.{self.name}"
        where = f"{self.kind}: " if self.kind else ""
        return f"{where}{self.name}" + (f" (spec line {self.spec_line})" if self.spec_line else "")


def kind_order(source: str) -> dict[str, int]:
    """The order the layer loop's body runs each kind's body in (`k.run_layers({...})`'s)."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "run_layers" and node.args
                and isinstance(node.args[0], ast.Dict)):
            return {k.value: n for n, k in enumerate(node.args[0].keys)
                    if isinstance(k, ast.Constant)}
    return {}


def line_labels(source: str) -> dict[int, Label]:
    """Line -> what it runs, for every line of the kernel's functions (`_kernel`, `_layer_<kind>`
    and the functions they nest)."""
    tree = ast.parse(source)
    text = source.splitlines()
    labels: dict[int, Label] = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        if fn.name.startswith("_layer_"):
            kind = fn.name[len("_layer_"):]
        elif fn.name == "_kernel":
            kind = ""
        else:
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.stmt) and not isinstance(
                    node, (ast.FunctionDef, ast.With, ast.If, ast.For, ast.While)):
                label = _statement(node, kind, text)
                for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                    labels.setdefault(line, label)
        for node in ast.walk(fn):            # a tail op's `with scopes.op(TAIL, "name"):` block
            if isinstance(node, ast.With) and (name := _tail_op(node)):
                for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                    labels[line] = Label("op", "tail", name)
    return labels


def _statement(node: ast.stmt, kind: str, text: list[str]) -> Label:
    calls = [c.func for c in ast.walk(node) if isinstance(c, ast.Call)
             and isinstance(c.func, ast.Attribute)]
    owners = [(c.value.id if isinstance(c.value, ast.Name) else "", c.attr) for c in calls]
    spec = _SPEC_LINE.search(text[node.lineno - 1])
    spec_line = int(spec.group(1)) if spec else 0
    for owner, attr in owners:
        if owner == "lower":
            return Label("op", kind, attr)
    for owner, attr in owners:
        if owner == "k" and attr in _COLLECTIVES:
            return Label("collective", kind, _COLLECTIVES[attr], spec_line)
    for owner, attr in owners:
        if attr in _COPIES:
            return Label("copies", kind, "copies", spec_line)
    for owner, attr in owners:
        if attr in _KERNEL_CALLS:
            return Label("kernel", kind, _KERNEL_CALLS[attr])
    return Label("kernel", kind, "other")


def _tail_op(node: ast.With) -> str | None:
    for item in node.items:
        c = item.context_expr
        if (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "op"
                and len(c.args) == 2 and isinstance(c.args[1], ast.Constant)):
            return str(c.args[1].value)
    return None


# ---- charging bundles to rows --------------------------------------------------------------
@dataclass
class Row:
    """One op, collective, copy group or kernel statement of the compiled kernel."""

    key: str
    group: str
    kind: str
    name: str
    spec_line: int = 0
    bundles: float = 0.0                 # as compiled: each loop body once
    cycles: float = 0.0                  # per call: counted loops expanded
    per_iteration: float = 0.0           # per iteration of its run-time loops
    slots: dict[str, float] = field(default_factory=dict)   # instructions per call, by kind
    bound: str = ""
    busiest: float = 0.0                 # the bound's share of its capacity
    run_time_loops: int = 0
    # Of `cycles`, those in counted loops that wait for a copy each iteration (a ring tile):
    # the step-time model charges them per read, `reads` of them a call.
    read_cycles: float = 0.0
    reads: int = 0
    hottest: dict = field(default_factory=dict)   # first/last address, trips, bundles

    def to_json(self) -> dict:
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(self).items()}


def charge(bundles: list[llo.Bundle], labels: dict[int, Label], layer_loop: llo.Loop | None,
           kinds: dict[str, int] | None = None, run_time_ops: set[str] | None = None
           ) -> list[list[tuple[Label, llo.Instruction]]]:
    """Each bundle's instructions with the row each is charged to.

    A location is trusted only where it agrees with program order. libtpu keeps the location
    of the first of equal instructions it merges (constants, address arithmetic), so a later
    op's loop carries an earlier op's line; and the generated module's lines run in the order
    the kernel executes them (inside the layer loop, kind by kind in `kinds`' order). The
    trusted locations are the longest run of them that never goes back in that order (inside
    the layer loop, and outside it, separately), with a layer kind's
    rows only inside the layer loop and the kernel's and tail's only outside; inside it, where
    the loop's dispatch splits the body into each kind's branch (`_branches`), a location
    is trusted only as an op of its branch's kind. Every other instruction is charged to the
    trusted row before it (after it, at the kernel's and at a branch's start)."""
    located: list[tuple[int, int, tuple[int, int], Label]] = []   # (bundle, instr, order, row)
    for i, b in enumerate(bundles):
        inside = layer_loop is not None and i in layer_loop
        for j, ins in enumerate(b.instructions):
            line = next((ln for ln in ins.lines if ln in labels), None)
            if ins.slot is None or line is None:
                continue
            lab = labels[line]
            if layer_loop is None or inside == (lab.kind not in ("", "tail")
                                                or lab.name == "layer loop"):
                order = (kinds or {}).get(lab.kind, -1) if inside else -1
                located.append((i, j, (order, line), lab))
    # Kinds whose bodies run the same code share it (JAX lowers an equal loop body once), and
    # it keeps the first kind's locations: inside the layer loop a location names an op (or
    # collective, copy) of any kind that has it, and the run picks which.
    same: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for line, lab in labels.items():
        if lab.kind not in ("", "tail"):
            same[lab.group, lab.name, lab.spec_line].append(((kinds or {}).get(lab.kind, -1), line))
    branches = _branches(located, layer_loop, kinds or {}, same)
    trusted: dict[tuple[int, int], Label] = {}
    for inside in (True, False):
        run = []
        for i, j, order, lab in located:
            if (layer_loop is not None and i in layer_loop) != inside:
                continue
            options = same[lab.group, lab.name, lab.spec_line] if inside else [order]
            if inside and branches is not None:
                options = [o for o in options if o[0] == branches.kind(i)]
                if not options:
                    continue
            run.append((i, j, sorted(set(options), reverse=True)))
        for i, j, order in _non_decreasing(run):
            trusted[i, j] = labels[order[1]]
    # A branch's instructions before its first trusted one are its first op's, not the
    # previous branch's last.
    opening: dict[int, Label] = {}
    if branches is not None:
        for (i, _), lab in sorted(trusted.items()):
            if i in layer_loop:
                opening.setdefault(branches.index(i), lab)
    owners: list[list[tuple[Label | None, llo.Instruction]]] = []
    last, branch = None, None
    for i, b in enumerate(bundles):
        mine = []
        if branches is not None and i in layer_loop and branches.index(i) != branch:
            branch = branches.index(i)
            last = opening.get(branch, last)
        for j, ins in enumerate(b.instructions):
            if ins.slot is None:
                continue
            last = trusted.get((i, j), last)
            mine.append((last, ins))
        owners.append(mine)
    first = next((lab for mine in owners for lab, _ in mine if lab is not None),
                 Label("kernel", "", "unlocated"))
    owners = [[(lab or first, ins) for lab, ins in mine] for mine in owners]
    _own_run_time_loops(bundles, owners, labels, layer_loop, run_time_ops or set())
    return owners


@dataclass(frozen=True)
class Branches:
    """The layer loop's body split into the kinds' branches: segment n starts at bundle
    `starts[n]` and runs kind order `kinds[n]`."""

    starts: list[int]
    kinds: list[int]

    def index(self, bundle: int) -> int:
        return bisect.bisect_right(self.starts, bundle) - 1

    def kind(self, bundle: int) -> int:
        return self.kinds[self.index(bundle)]


def _branches(located: list[tuple[int, int, tuple[int, int], Label]],
              layer_loop: llo.Loop | None, kinds: dict[str, int],
              same: dict[tuple, list[tuple[int, int]]]) -> Branches | None:
    """Which kind's branch each bundle of the layer loop's body belongs to, or None when the
    body cannot be split. The layer loop dispatches to one branch per kind and libtpu lays the
    branches out one after another in kind order, each after an instruction of the dispatch
    (located at the layer loop's line): those split the body into segments. Code equal in two
    branches is merged and keeps the location of the kind laid out first (the dense layer's
    mix, say, in every kind's branch), so a kind's own locations (of ops no other kind has)
    turn up in other branches too, but most of them in its own: segments are given kinds in
    kind order so as to hold the largest shares of them. Only the split says such an
    instruction runs in another kind's branch, where it is charged to the op before it rather
    than pulling the whole branch into another kind's run."""
    if layer_loop is None or len(kinds) < 2:
        return None
    marks = sorted({i for i, _, _, lab in located if i in layer_loop and lab.name == "layer loop"
                    and lab.kind == ""})
    starts = [layer_loop.first] + [m for m in marks if layer_loop.first < m]
    if len(starts) < len(kinds):
        return None
    only = {key: opts[0][0] for key, opts in same.items() if len({o[0] for o in opts}) == 1}
    hits = [defaultdict(int) for _ in starts]
    for i, _, _, lab in located:
        order = only.get((lab.group, lab.name, lab.spec_line))
        if i in layer_loop and order is not None:
            hits[bisect.bisect_right(starts, i) - 1][order] += 1
    # Segments to kinds, in kind order (a small DP), holding the most of each kind's own
    # locations as a share of all of them: merged code lends a kind with many ops its
    # locations in other branches, but a branch holds most of its kind's own.
    n_kinds = max(kinds.values()) + 1
    own = [sum(h.get(k, 0) for h in hits) or 1 for k in range(n_kinds)]
    best = [[0.0] * n_kinds for _ in starts]
    back = [[0] * n_kinds for _ in starts]
    for s, h in enumerate(hits):
        for k in range(n_kinds):
            prev = max(range(k + 1), key=lambda q: best[s - 1][q]) if s else k
            best[s][k] = (best[s - 1][prev] if s else 0.0) + h.get(k, 0) / own[k]
            back[s][k] = prev
    k = max(range(n_kinds), key=lambda q: best[-1][q])
    assigned = [0] * len(starts)
    for s in range(len(starts) - 1, -1, -1):
        assigned[s] = k
        k = back[s][k]
    # A split that leaves a kind with under half its own locations in its segments is not
    # the dispatch's (several kinds' branches between two of its instructions).
    held = [sum(h.get(k, 0) for h, a in zip(hits, assigned) if a == k) for k in range(n_kinds)]
    if len(set(assigned)) < 2 or any(2 * held[k] < own[k] for k in range(n_kinds)
                                     if any(h.get(k) for h in hits)):
        return None
    return Branches(starts, assigned)


def _own_run_time_loops(bundles: list[llo.Bundle], owners: list, labels: dict[int, Label],
                        layer_loop: llo.Loop | None, run_time_ops: set[str]) -> None:
    """A loop decided at run time (routed experts, KV tiles) is one op's: the first op with
    such a loop (`run_time_ops`, from the traced kernel) at or after the op that runs before
    it, in that op's layer kind. Its few located instructions do not say so (most are merged
    with other ops' or unlocated), so the whole loop is charged to that op."""
    if not run_time_ops:
        return
    line_of = {}
    for line, lab in sorted(labels.items()):
        line_of.setdefault(lab, line)
    for lp in llo.loops(bundles):
        base = layer_loop.depth if layer_loop is not None and lp.first in layer_loop else 0
        if lp.trips is not None or lp.depth != base + 1:
            continue
        before = next((lab for i in range(lp.first - 1, -1, -1) for lab, _ in owners[i][::-1]
                       if lab.group == "op"), None)
        if before is None:
            continue
        after = [lab for lab, line in line_of.items() if lab.group == "op"
                 and lab.kind == before.kind and lab.key in run_time_ops
                 and line >= line_of[before]]
        if not after:
            continue
        owner = min(after, key=line_of.get)
        for i in range(lp.first, lp.last + 1):
            owners[i] = [(owner, ins) for _, ins in owners[i]]


def _non_decreasing(seq: list[tuple[int, int, list]]) -> list[tuple[int, int, tuple]]:
    """The longest run through `seq` that never decreases, each element taking one of its
    options (largest first; patience sorting): [(bundle, instruction, option taken)]."""
    tails: list = []                       # smallest last option of a run of each length
    ends: list[int] = []                   # node of that run's last element
    nodes: list[tuple[int, int, int, tuple]] = []      # (seq index, back node, option)
    for n, (_, _, options) in enumerate(seq):
        for opt in options:
            k = bisect.bisect_right(tails, opt)
            nodes.append((n, ends[k - 1] if k else -1, opt))
            if k == len(tails):
                tails.append(opt)
                ends.append(len(nodes) - 1)
            else:
                tails[k], ends[k] = opt, len(nodes) - 1
    out, node = [], ends[-1] if ends else -1
    while node >= 0:
        n, back, opt = nodes[node]
        out.append((seq[n][0], seq[n][1], opt))
        node = back
    return out[::-1]


def _depth(layer_loop: llo.Loop | None, in_layers: bool) -> int:
    """The loop depth ops are called at: inside the layer loop, its depth; else the kernel's."""
    return layer_loop.depth if layer_loop is not None and in_layers else 0


def find_layer_loop(loops: list[llo.Loop], layers: int) -> llo.Loop | None:
    """The loop over the layers: the largest loop of `layers` iterations."""
    fit = [lp for lp in loops if lp.trips == layers]
    return max(fit, key=lambda lp: lp.last - lp.first) if fit else None


def _shares(owners: list[list[tuple[Label, llo.Instruction]]]) -> list[dict[Label, float]]:
    """A bundle's cycle split over its rows by their instructions (an empty bundle, a delay,
    goes with the bundle before it; one before any owned bundle, with the first owned one)."""
    shares, prev = [], {}
    for mine in owners:
        if mine:
            per: dict[Label, float] = defaultdict(float)
            for lab, _ in mine:
                per[lab] += 1.0 / len(mine)
            prev = dict(per)
        shares.append(prev)
    first = next((sh for sh in shares if sh), {})
    return [sh or first for sh in shares]        # only the leading ones are empty


def rows(bundles: list[llo.Bundle], labels: dict[int, Label], layers: int,
         kinds: dict[str, int] | None = None, run_time_ops: set[str] | None = None,
         body: list[llo.Loop] | None = None) -> list[Row]:
    """The kernel's rows, costliest per call first (`layers`: the trips of the layer loop;
    `kinds`: the order its body runs the kinds in, `kind_order`; `run_time_ops`: the ops with
    a loop decided at run time, "kind.op"; `body`: the kernel's `llo.loops`, if read)."""
    body = llo.loops(bundles) if body is None else body
    layer_loop = find_layer_loop(body, layers)
    owners = charge(bundles, labels, layer_loop, kinds, run_time_ops)
    shares = _shares(owners)
    enclosing: list[list[llo.Loop]] = [[] for _ in bundles]
    for loop in body:
        for i in range(loop.first, loop.last + 1):
            enclosing[i].append(loop)
    cap = llo.slot_capacity(bundles)
    waiting = {lp for lp in body if any(ins.mnemonic == "dma.done.wait"
                                        for b in bundles[lp.first:lp.last + 1]
                                        for ins in b.instructions)}
    out: dict[Label, Row] = {}
    touched: dict[Label, float] = defaultdict(float)
    hottest: dict[Label, llo.Loop] = {}
    read_loops: dict[Label, set[llo.Loop]] = defaultdict(set)
    run_time_loops: dict[Label, set[llo.Loop]] = defaultdict(set)
    for i, (b, sh) in enumerate(zip(bundles, shares)):
        base = _depth(layer_loop, layer_loop is not None and i in layer_loop)
        inner = [lp for lp in enclosing[i] if lp.depth > base]
        times = 1.0
        for lp in inner:
            times *= lp.trips or 1
        run_time = any(lp.trips is None for lp in inner)
        mine = {lab for lab, _ in owners[i]}
        for lab, share in sh.items():
            row = out.get(lab)
            if row is None:
                row = out[lab] = Row(lab.key, lab.group, lab.kind, lab.name, lab.spec_line)
            row.bundles += share
            if run_time:
                row.per_iteration += share * times
                run_time_loops[lab].update(lp for lp in inner if lp.trips is None)
            else:
                row.cycles += share * times
                if inner and inner[0] in waiting:
                    row.read_cycles += share * times
                    read_loops[lab].add(inner[0])
            if lab in mine:
                touched[lab] += times
            if inner:
                lp, hot = inner[-1], hottest.get(lab)
                if hot is None or _weight(lp) > _weight(hot):
                    hottest[lab] = lp
        for lab, ins in owners[i]:
            row = out[lab]
            row.slots[ins.slot] = row.slots.get(ins.slot, 0.0) + times
    for lab, row in out.items():
        row.reads = sum(lp.trips or 0 for lp in read_loops[lab])
        use = {k: v / (touched[lab] * cap[k]) for k, v in row.slots.items() if touched[lab]}
        if use:
            k = max(use, key=use.get)
            row.bound, row.busiest = (k, use[k]) if use[k] >= 0.5 else ("dependencies", use[k])
        row.run_time_loops = len(run_time_loops[lab])
        lp = hottest.get(lab)
        first, last = (lp.first, lp.last) if lp else _longest_run(shares, lab)
        row.hottest = {"first": bundles[first].address, "last": bundles[last].address,
                       "trips": lp.trips if lp else 1, "depth": bundles[first].depth,
                       "bundles": [" ;; ".join(ins.text for _, ins in owners[j])[:HOTTEST_TEXT]
                                   for j in range(first, min(last + 1, first + HOTTEST_BUNDLES))]}
    return sorted(out.values(), key=lambda r: -(r.cycles + r.per_iteration))


def _weight(lp: llo.Loop) -> int:
    return (lp.trips or 1) * (lp.last - lp.first + 1)


def _longest_run(shares: list[dict[Label, float]], lab: Label) -> tuple[int, int]:
    """The longest run of bundles mostly the row's (its hottest straight-line region)."""
    best, start = (0, 0), None
    for i, sh in enumerate([*shares, {}]):
        if sh.get(lab, 0.0) > 0.5:
            start = i if start is None else start
        elif start is not None:
            if i - 1 - start > best[1] - best[0]:
                best = (start, i - 1)
            start = None
    return best


# ---- compiling, caching, reporting ---------------------------------------------------------
def cache_key(source: str, kernel: str, batch: int, libtpu: str,
              verify_rows: int | None = None) -> str:
    """What a measure depends on: the kernel the module traces to (`work.kernel_digest`: what
    libtpu compiles), the rows its statements are charged to (`line_labels`, in order: its
    comments and host code may change, and mkc's own code be rewritten, without a compile as
    long as both stay), kernel, rows, and the JAX and libtpu versions."""
    from mkc.perf.work import kernel_digest
    rows = verify_rows * batch if verify_rows else batch
    labels = [lab for _, lab in sorted(line_labels(source).items())]
    named = [lab for n, lab in enumerate(labels) if n == 0 or lab != labels[n - 1]]
    h = hashlib.sha256()
    for part in (kernel_digest(source, rows, verify_rows), repr(named), kernel, str(batch),
                 _version("jax"), libtpu):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:20]


def layer_calls(s: ir.ScheduleIR) -> dict[str, int]:
    """Calls of each layer kind's body a step (the tail, once)."""
    calls: dict[str, int] = defaultdict(int)
    for kind in s.layer_kinds:
        calls[kind] += 1
    return dict(calls) | {"tail": 1, "": 1}


def measure(s: ir.ScheduleIR, kernel: str = "decode", batch: int | None = None,
            timeout: float = 1800.0, source: str | None = None, tick=None) -> dict:
    """Compile the module mkc emits for `s` (or `source`) with libtpu and read its bundles:
    the decode kernel at `batch` rows (default: the spec's largest), or the verify kernel for
    `batch` sequences. Raises BundleError when libtpu cannot."""
    from mkc.codegen.emit import render
    from mkc.confirm import LOCATE_IN_MODULE, run_compile
    source = source if source is not None else render(s, "")
    verify_rows = s.verify_rows if kernel == "verify" else None
    batch = batch or (s.verify_sequences[0] if verify_rows else s.batch_max)
    with tempfile.TemporaryDirectory(prefix="mkc-bundles-") as tmp:
        module = Path(tmp) / f"mkc_bundles_{s.name}.py"
        module.write_text(source)
        r = run_compile(module, batch, timeout, tick=tick, verify_rows=verify_rows,
                        env={"LIBTPU_INIT_ARGS": _DUMP.format(Path(tmp) / "jf"),
                             LOCATE_IN_MODULE: "1"})
        if r["libtpu"] != "fits":
            raise BundleError(f"libtpu did not compile the {kernel} kernel of {s.name} for "
                              f"{s.topology}: {r['libtpu']}: {r['message']}")
        dumped = llo.kernel_file(Path(tmp) / "jf", module.name)
        if dumped is None:
            raise BundleError(f"libtpu wrote no located LLO for the {kernel} kernel of {s.name}")
        text = dumped.read_text(errors="replace")
    parsed = llo.parse(text, module.name)
    body = llo.loops(parsed)
    layers = len(s.layer_kinds)
    from mkc.perf.work import kernel_work
    traced = kernel_work(s, s.verify_rows * batch if verify_rows else batch, verify_rows)
    run_time = {f"{k}.{o}" for k, o in traced.run_time_loop_ops}
    found = rows(parsed, line_labels(source), layers, kind_order(source), run_time, body)
    calls = layer_calls(s)
    lib = libtpu_version()
    return {"schema": SCHEMA, "key": cache_key(source, kernel, batch, lib, verify_rows), "spec": s.name,
            "chip": s.chip, "topology": s.topology, "kernel": kernel, "batch": batch,
            "verify_rows": verify_rows, "libtpu": lib, "bundles": len(parsed),
            "slot_capacity": llo.slot_capacity(parsed),
            "layer_loop": find_layer_loop(body, layers) is not None,
            "calls": calls, "compile_seconds": round(r.get("seconds", 0.0), 1),
            "rows": [row.to_json() for row in found]}


def user_cache() -> Path:
    """Where measures of specs mkc does not ship are kept (MKC_BUNDLE_CACHE overrides)."""
    if own := os.environ.get("MKC_BUNDLE_CACHE"):
        return Path(own)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mkc" / "bundles"


def cached(s: ir.ScheduleIR, kernel: str, batch: int, source: str | None = None,
           places: tuple[Path, ...] | None = None) -> dict | None:
    """A measure of this exact module, kernel, rows and libtpu, from the shipped data or the
    user's cache (or `places`)."""
    from mkc.codegen.emit import render
    source = source if source is not None else render(s, "")
    key = cache_key(source, kernel, batch, libtpu_version(),
                    s.verify_rows if kernel == "verify" else None)
    for place in places or (DATA, user_cache()):
        path = place / f"{s.name}.json"
        try:
            entries = json.loads(path.read_text())["measures"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for e in entries:
            if isinstance(e, dict) and e.get("key") == key and e.get("schema") == SCHEMA:
                return e
    return None


def save(entry: dict, directory: Path | None = None) -> Path:
    """Keep a measure beside the others of its spec (one per key), atomically."""
    from mkc.files import write_atomically
    path = (directory or user_cache()) / f"{entry['spec']}.json"
    try:
        entries = json.loads(path.read_text())["measures"]
    except (OSError, ValueError, KeyError, TypeError):
        entries = []
    # one per key, of this schema; a spec's variants (formats, geometry) share its name and
    # file, newest kept
    entries = [e for e in entries if isinstance(e, dict) and e.get("key") != entry["key"]
               and e.get("schema") == SCHEMA]
    entries = sorted((entries + [entry])[-KEEP:], key=lambda e: (e["kernel"], e["batch"], e["key"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"measures": entries}, indent=1, sort_keys=True) + "\n")
    return path


def bundle_report(s: ir.ScheduleIR, kernel: str = "decode", batch: int | None = None,
                  compile_missing: bool = True, tick=None, verify_rows: int | None = None,
                  on_compile=None) -> dict:
    """The measure for `s`: cached, or compiled now (and cached) when `compile_missing`, after
    `on_compile()` if given. A verify kernel is the module's, of the spec's R rows a sequence:
    another `verify_rows` is a BundleError."""
    from mkc.codegen.emit import render
    verify = kernel == "verify"
    if verify and verify_rows is not None and verify_rows != s.verify_rows:
        raise BundleError(f"the module builds its verify kernel at {s.verify_rows} rows a "
                          f"sequence, not {verify_rows}: pass --verify {s.verify_rows}",
                          setting="verify")
    batch = batch or (s.verify_sequences[0] if verify else s.batch_max)
    source = render(s, "")
    got = cached(s, kernel, batch, source)
    if got is None:
        if not compile_missing:
            raise BundleError(f"no bundles measured for the {kernel} kernel of {s.name} at "
                              f"{batch} {'sequences' if verify else 'rows'} with libtpu "
                              f"{libtpu_version() or '(not installed)'}")
        if on_compile is not None:
            on_compile()
        got = measure(s, kernel, batch, source=source, tick=tick)
        save(got)
    return got


def per_step(entry: dict, row: dict) -> float:
    """A row's cycles over a step: per call times its kind's calls (run-time loops once)."""
    return (row["cycles"] + row["per_iteration"]) * entry["calls"].get(row["kind"], 1)


def text(entry: dict, op: str | None = None, top: int = 25) -> str:
    """The report: rows ranked by cycles a step, and with `op` that row's hottest region."""
    rows_ = sorted(entry["rows"], key=lambda r: -per_step(entry, r))
    total = sum(per_step(entry, r) for r in rows_)
    lines = [f"{entry['spec']}: {entry['kernel']} kernel at {entry['batch']} "
             f"{'sequences' if entry['verify_rows'] else 'rows'}, compiled by libtpu "
             f"{entry['libtpu']} for {entry['topology']} (compile-only; static schedule, "
             f"not a timing)",
             f"  {entry['bundles']} bundles as compiled; {total:,.0f} issue cycles a step with "
             f"counted loops expanded (run-time loops, the routed experts and KV tiles, once)",
             "",
             f"  {'row':<40} {'calls':>5} {'cycles/call':>12} {'per iter':>9} {'share':>6}  "
             f"{'bound':<13} busy"]
    for r in rows_[:top]:
        calls = entry["calls"].get(r["kind"], 1)
        lines.append(f"  {r['key']:<40} {calls:>5} {r['cycles']:>12,.0f} "
                     f"{r['per_iteration']:>9,.0f} {100 * per_step(entry, r) / total:>5.1f}%  "
                     f"{r['bound']:<13} {100 * r['busiest']:.0f}%")
    if len(rows_) > top:
        lines.append(f"  ... {len(rows_) - top} more rows (--json has every one)")
    if op is not None:
        r = next(x for x in rows_ if x["key"] == op)
        hot = r["hottest"]
        slots = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r["slots"].items(), key=lambda kv: -kv[1]))
        lines += ["", f"{op}: {r['bundles']:.0f} bundles as compiled, {r['cycles']:,.0f} cycles a "
                      f"call" + (f" + {r['per_iteration']:,.0f} per run-time iteration"
                                 if r["run_time_loops"] else ""),
                  f"  instructions a call by slot: {slots}",
                  f"  hottest region: bundles {hot['first']:#x}..{hot['last']:#x} at loop depth "
                  f"{hot['depth']}, " + (f"{hot['trips']} trips" if hot["trips"] else
                                        "trips decided at run time")]
        lines += [f"    {b}" for b in hot["bundles"]]
    return "\n".join(lines)


def row_keys(entry: dict) -> list[str]:
    return [r["key"] for r in entry["rows"]]

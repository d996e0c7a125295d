"""libtpu's final LLO, read: the instruction bundles of a compiled kernel, each with its loop
depth and its instructions, each instruction with the functional unit (slot kind) it issues to
and the source lines it was lowered from.

libtpu writes the LLO with `--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true`, and annotates
instructions with their source location with `--xla_mosaic_enable_llo_source_annotations=true`
(`loc("file":line:col ...)`, innermost user frame only). One bundle issues in one cycle of the
static schedule (DMA waits and semaphore stalls come on top). A bundle line reads

    0x4b2 LB: > { %v1 = vld [...] /* loc("m.py":263:17 to :82) */  ;;  %2 = vmatpush1... }

where `LB` marks a loop body's first bundle and each `>` a level of loop nesting.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Slot kinds, in report order.
MXU = "mxu"                  # weight pushes, matmuls, result pops
VPU = "vpu"                  # vector ALU (elementwise, compare, select, pack, sublane shuffles)
XLU = "xlu"                  # cross-lane unit (lane rotates and permutes, transposes, reductions)
EUP = "eup"                  # transcendentals and their result pops
VLOAD = "vector load"
VSTORE = "vector store"
SCALAR = "scalar"            # scalar ALU, SMEM loads and stores, branches, address arithmetic
DMA = "dma"                  # DMA descriptors issued and waited on
SYNC = "sync"                # semaphore (sync flag) updates and waits
SLOTS = (MXU, VPU, XLU, EUP, VLOAD, VSTORE, SCALAR, DMA, SYNC)

_EUP_OPS = ("vexp", "vlog", "vrcp", "vrsqrt", "vsqrt", "vtanh", "vpow", "vsin", "vcos", "verf",
            "vsigmoid", "vlogistic")
_PSEUDO = frozenset({"sphi", "vphi", "inlined_call_operand", "compiler-scheduling-barrier"})


def slot_of(mnemonic: str) -> str | None:
    """The slot kind an instruction issues to (None: a pseudo-instruction that takes none)."""
    base = mnemonic.split(".", 1)[0]
    if base in _PSEUDO:
        return None
    if ".xlu" in mnemonic or base in ("vxpose",):
        return XLU
    if base.startswith("vmat") or ".mxu" in mnemonic or mnemonic.startswith("vpop.f32.mr"):
        return MXU
    if mnemonic.startswith("vpop.eup") or base.startswith(_EUP_OPS):
        return EUP
    if base == "vld":
        return VLOAD
    if base in ("vst", "vstv"):
        return VSTORE
    if base == "dma":
        return DMA
    if base.startswith("vsync") or base in ("vwait", "sfence", "vdelay"):
        return SYNC
    return VPU if base.startswith("v") else SCALAR


@dataclass(frozen=True)
class Instruction:
    mnemonic: str
    slot: str | None
    lines: tuple[int, ...]       # source lines in the located file (innermost frame), if any
    text: str = field(default="", compare=False)   # the instruction without its comments


@dataclass
class Bundle:
    address: int
    depth: int                   # loop nesting
    loop_start: bool             # the first bundle of a loop body (`LB`)
    instructions: list[Instruction] = field(default_factory=list)


@dataclass(frozen=True)
class Loop:
    """A loop body: bundles [first, last] of the kernel (indices), at nesting `depth`; `trips`
    its iterations when the exit compares the counter with a constant (None: decided at run
    time, as the routed experts' and KV tiles' loops are)."""

    first: int
    last: int
    depth: int
    trips: int | None = None

    def __contains__(self, i: int) -> bool:
        return self.first <= i <= self.last


_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:([A-Z]{2}))?:\s*(>*)\s*\{", re.M)
_MNEMONIC = re.compile(r"\s*(?:%[\w.]+\s*=\s*)?([A-Za-z_][\w.\-]*)")
_LOC = re.compile(r'loc\("([^"]+)":(\d+)')
_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_STEP = re.compile(r"(%s[\w]+) = sadd\.s32 1, %s")
_EXIT = re.compile(r"scmp\.ge\.s32\.totalorder (%s[\w]+), (\d+|%s[\w]+)$")


def parse(text: str, located: str | None = None) -> list[Bundle]:
    """The bundles of one final-LLO text; instruction lines are kept for locations in files
    whose path ends with `located` (every file when None)."""
    starts = list(_BUNDLE.finditer(text))
    bundles = []
    for n, m in enumerate(starts):
        end = starts[n + 1].start() if n + 1 < len(starts) else len(text)
        body = text[m.end():end]
        close = body.rfind("}")
        body = body[:close] if close >= 0 else body
        b = Bundle(int(m.group(1), 0), len(m.group(3)), m.group(2) == "LB")
        for part in body.split(";;"):
            mm = _MNEMONIC.match(part)
            if mm is None:
                continue
            lines = tuple(sorted({int(line) for path, line in _LOC.findall(part)
                                  if located is None or path.endswith(located)}))
            b.instructions.append(Instruction(mm.group(1), slot_of(mm.group(1)), lines,
                                              _COMMENT.sub("", part).strip()))
        if not b.instructions and not m.group(3) and bundles:
            b.depth = bundles[-1].depth          # an empty bundle (a delay) prints no nesting
        bundles.append(b)
    return bundles


def loops(bundles: list[Bundle]) -> list[Loop]:
    """Every loop body: from its `LB` bundle while the nesting stays at least its depth."""
    out = []
    for i, b in enumerate(bundles):
        if not b.loop_start:
            continue
        j = i
        while j + 1 < len(bundles) and bundles[j + 1].depth >= b.depth:
            j += 1
        out.append(Loop(i, j, b.depth, _trips(bundles[i:j + 1])))
    return out


def _trips(body: list[Bundle]) -> int | None:
    """A counted loop's iterations: its counter steps by one (`sadd.s32 1`) from 0, as Mosaic
    lowers `fori_loop(0, n)`, and it exits when the counter reaches the constant n; None when
    it exits at a register's value (decided at run time). Only the loop's own bundles are read:
    a loop nested in it has its own counter and exit test."""
    own = [b for b in body if b.depth == body[0].depth]
    counters = {m.group(1) for b in own for i in b.instructions if (m := _STEP.match(i.text))}
    for b in reversed(own):
        for i in b.instructions:
            m = _EXIT.search(i.text)
            if m and m.group(1) in counters:
                return int(m.group(2)) if m.group(2).isdigit() else None
    return None


def slot_capacity(bundles: list[Bundle]) -> dict[str, int]:
    """Instructions of each slot kind one bundle can hold, as the compiled code shows it: the
    most any bundle issues (a lower bound on the hardware's slots)."""
    cap: Counter = Counter()
    for b in bundles:
        per = Counter(i.slot for i in b.instructions if i.slot)
        for k, v in per.items():
            cap[k] = max(cap[k], v)
    return {k: cap.get(k, 1) or 1 for k in SLOTS}


def kernel_file(dump_dir: Path, located: str) -> Path | None:
    """The final-bundles file of the kernel whose instructions are located in `located` (the
    generated module): the one of libtpu's dumps that names it most."""
    best, hits = None, 0
    for f in Path(dump_dir).rglob("*final_bundles.txt"):
        if "schedule-analysis" in f.name:
            continue
        n = f.read_text(errors="replace").count(located)
        if n > hits:
            best, hits = f, n
    return best

"""Lower one layer kind's step sequence (`mkc.program`) to the source of its layer function.

Each op becomes one call into the family's lowering registry with its register values as
locals (`proj = lower.in_proj(c, h)`); state copies, drains and collectives become calls on the
layer context, each with a comment naming the spec line it comes from. A `scoped` range becomes
a nested function run by `pl.run_scoped`: it takes the values it reads from before it and
returns the values it defines that are read after it.
"""
from __future__ import annotations

from mkc import ir
from mkc.program import Step, layer_program
from mkc.runtime.context import copy_name

# An IR dtype as the generated module spells it (it defines BF16 and F32).
DTYPE_SOURCE = {"bf16": "BF16", "f32": "F32", "int32": "jnp.int32"}


def gather_name(kind: str, op: str) -> str:
    """The module constant of the all-gather (or sibling exchange) of `op`'s output in `kind`."""
    return f"{kind}_{op}_gather".upper()


def reduce_name(kind: str, op: str) -> str:
    """The module constant holding the all-reduce stages of `op`'s output in `kind`."""
    return f"{kind}_{op}_reduce".upper()


def _where(span) -> str:
    """Where in the spec a step comes from, for the comment beside it."""
    known = span is not None and (span.line, span.column, span.end_line, span.end_column) != (1, 1, 1, 1)
    return f"spec line {span.line}" if known else "spec"


def _reads_writes(k: ir.KindSchedule, step: Step) -> tuple[list[str], list[str]]:
    if step.kind == "op":
        return k.op_values.get(step.op, ([], []))
    if step.kind in ("allreduce", "allgather", "exchange"):
        value = k.op_values[step.op][1][0]
        return [value], [value]
    return [], []


class _Emitter:
    def __init__(self, s: ir.ScheduleIR, kind: str):
        self.s, self.kind, self.k = s, kind, s.kinds[kind]
        self.steps = layer_program(s, kind)
        self.lines: list[str] = []

    def _live_after(self, index: int) -> set[str]:
        """Values read after step `index` before being defined again."""
        live: set[str] = set()
        redefined: set[str] = set()
        for step in self.steps[index + 1:]:
            reads, writes = _reads_writes(self.k, step)
            live |= set(reads) - redefined
            redefined |= set(writes)
        return live

    def _line(self, indent: str, text: str) -> None:
        self.lines.append(indent + text)

    def emit(self) -> list[str]:
        self._block(0, len(self.steps), "    ")
        return self.lines

    def _block(self, lo: int, hi: int, indent: str) -> None:
        i = lo
        while i < hi:
            step = self.steps[i]
            if step.kind == "scope_open":
                close = next(j for j in range(i + 1, hi) if self.steps[j].kind == "scope_close"
                             and self.steps[j].scope == step.scope)
                self._scope(i, close, indent)
                i = close + 1
                continue
            self._step(step, indent)
            i += 1

    def _scope(self, open_i: int, close_i: int, indent: str) -> None:
        step = self.steps[open_i]
        defined_before: set[str] = set()
        for st in self.steps[:open_i]:
            defined_before |= set(_reads_writes(self.k, st)[1])
        inside_reads: list[str] = []
        inside_writes: list[str] = []
        for st in self.steps[open_i + 1:close_i]:
            r, w = _reads_writes(self.k, st)
            inside_reads += [v for v in r if v not in inside_reads]
            inside_writes += [v for v in w if v not in inside_writes]
        params = [v for v in inside_reads if v in defined_before]
        later = self._live_after(close_i)
        returns = [v for v in inside_writes if v in later]
        names = [b.name for b in step.buffers]
        short = [n[len(self.kind) + 1:] if n.startswith(self.kind + "_") else n for n in names]
        fn = f"_scope_{step.scope}"
        self._line("", "")
        self._line(indent, f"def {fn}({', '.join(['c', *params])}):")
        self._line(indent, f'    """Runs with {", ".join(short)} allocated (pl.run_scoped)."""')
        self._block(open_i + 1, close_i, indent + "    ")
        if returns:
            self._line(indent, f"    return {', '.join(returns)}{',' if len(returns) == 1 else ''}")
        self._line("", "")
        bind = ", ".join(f"{n}={s}" for n, s in zip(names, short))
        call = f"lambda {', '.join(short)}: {fn}({', '.join([f'c.scoped({bind})', *params])})"
        target = f"{', '.join(returns)}{',' if len(returns) == 1 else ''} = " if returns else ""
        self._line(indent, f"{target}pl.run_scoped(")
        self._line(indent, f"    {call},")
        for b in step.buffers:
            self._line(indent, f"    pltpu.VMEM({b.shape_expr()}, {DTYPE_SOURCE[b.dtype]}),   # {b.name}")
        self._line(indent, ")")

    def _step(self, step: Step, indent: str) -> None:
        k, kind = self.k, self.kind
        if step.kind == "vectors":
            self._line(indent, "c.vectors_arrive()   # this layer's vectors; issue the next ones")
        elif step.kind in ("start", "wait"):
            t = step.transfer
            arrow = (f"state.{t.state} -> {t.buffer}" if t.direction == "load"
                     else f"{t.buffer} -> state.{t.state}")
            name = copy_name(t.direction, t.buffer)
            self._line(indent, f'c.copy("{name}").{step.kind}()   # {_where(t.span)}: {t.direction} {arrow}')
        elif step.kind == "drain":
            t = step.transfer
            self._line("", "")
            self._line(indent, "@pl.when(c.si > 0)")
            self._line(indent, f"def _():   # {_where(t.span)}: the previous {kind} layer's {t.direction} "
                               f"of state.{t.state} drains here")
            self._line(indent, f'    c.copy("{copy_name(t.direction, t.buffer)}", previous=True).wait()')
        elif step.kind == "op":
            reads, writes = k.op_values.get(step.op, ([], []))
            call = f"lower.{step.op}({', '.join(['c', *reads])})"
            target = f"{', '.join(writes)} = " if writes else ""
            self._line(indent, f"{target}{call}")
        elif step.kind == "allreduce":
            a = step.allreduce
            value = k.op_values[step.op][1][0]
            self._line(indent, f"{value} = k.allreduce({value}, {reduce_name(kind, step.op)})   "
                               f"# {_where(a.span)}: {a.algorithm}, wire {a.wire_dtype}")
        elif step.kind == "fetch":
            f = k.fetch
            self._line(indent, f"# {_where(f.span)}: fetch experts -> {f.pool}.{f.view}, the first slots now")
            self._line(indent, "c.start_experts()")
        elif step.kind == "prefetch":
            f = k.prefetch
            self._line(indent, f"c.prefetch_view()   # {_where(f.span)}: "
                               f"prefetch next {f.pool}.{f.view}")
        elif step.kind == "pool_wait":
            self._line(indent, f'c.wait_pooled("{step.family}")   # {step.view}: before its first reader')
        elif step.kind in ("allgather", "exchange"):
            g = step.collective
            value = k.op_values[step.op][1][0]
            what = (f"all-gather over {g.size} ranks" if step.kind == "allgather"
                    else f"swap with the sibling core, wire {g.wire_dtype}")
            self._line(indent, f"{value} = k.allgather({value}, {gather_name(kind, step.op)})   "
                               f"# {_where(g.span)}: {what}")
        elif step.kind == "view_close":
            self._line(indent, f"# the pool view {step.view} is free from here")
        else:
            raise ValueError(f"the generic lowering has no step {step.kind!r} yet")


def layer_source(s: ir.ScheduleIR, kind: str) -> str:
    """The body of `_layer_<kind>(k, layer)` (indented four spaces)."""
    return "\n".join(_Emitter(s, kind).emit())

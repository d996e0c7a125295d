"""Lower one layer kind's step sequence (`mkc.program`) to the source of its layer function.

Each op becomes one call into the family's lowering registry with its register values as
locals (`proj = lower.in_proj(c, h)`); state copies, drains and collectives become calls on the
layer context, each with a comment naming the spec line it comes from. A `scoped` range becomes
a nested function run by `pl.run_scoped`: it takes the values it reads from before it and
returns the values it defines that are read after it.
"""
from __future__ import annotations

from mkc import ir
from mkc.program import layer_program
from mkc.steps import ScopeClose, ScopeOpen

# An IR dtype as the generated module spells it (it defines BF16 and F32).
DTYPE_SOURCE = {"bf16": "BF16", "f32": "F32", "int32": "jnp.int32"}


class LayerEmitter:
    """The source of one layer kind's function: each step emits its own lines
    (`step.emit(e, indent)`); scopes become nested `pl.run_scoped` functions here."""

    def __init__(self, s: ir.ScheduleIR, kind: str):
        self.s, self.kind, self.k = s, kind, s.kinds[kind]
        self.steps = layer_program(s, kind)
        self.lines: list[str] = []

    def _live_after(self, index: int) -> set[str]:
        """Values read after step `index` before being defined again."""
        live: set[str] = set()
        redefined: set[str] = set()
        for step in self.steps[index + 1:]:
            reads, writes = step.values(self.k)
            live |= set(reads) - redefined
            redefined |= set(writes)
        return live

    def line(self, indent: str, text: str) -> None:
        self.lines.append(indent + text)

    def emit(self) -> list[str]:
        self._block(0, len(self.steps), "    ")
        return self.lines

    def _block(self, lo: int, hi: int, indent: str) -> None:
        i = lo
        while i < hi:
            step = self.steps[i]
            if isinstance(step, ScopeOpen):
                close = next(j for j in range(i + 1, hi) if isinstance(self.steps[j], ScopeClose)
                             and self.steps[j].scope == step.scope)
                self._scope(i, close, indent)
                i = close + 1
                continue
            step.emit(self, indent)
            i += 1

    def _scope(self, open_i: int, close_i: int, indent: str) -> None:
        step = self.steps[open_i]
        defined_before: set[str] = set()
        for st in self.steps[:open_i]:
            defined_before |= set(st.values(self.k)[1])
        inside_reads: list[str] = []
        inside_writes: list[str] = []
        for st in self.steps[open_i + 1:close_i]:
            r, w = st.values(self.k)
            inside_reads += [v for v in r if v not in inside_reads]
            inside_writes += [v for v in w if v not in inside_writes]
        params = [v for v in inside_reads if v in defined_before]
        later = self._live_after(close_i)
        returns = [v for v in inside_writes if v in later]
        names = [b.name for b in step.buffers]
        short = [n[len(self.kind) + 1:] if n.startswith(self.kind + "_") else n for n in names]
        fn = f"_scope_{step.scope}"
        self.line("", "")
        self.line(indent, f"def {fn}({', '.join(['c', *params])}):")
        self.line(indent, f'    """Runs with {", ".join(short)} allocated (pl.run_scoped)."""')
        self._block(open_i + 1, close_i, indent + "    ")
        if returns:
            self.line(indent, f"    return {', '.join(returns)}{',' if len(returns) == 1 else ''}")
        self.line("", "")
        bind = ", ".join(f"{n}={s}" for n, s in zip(names, short))
        call = f"lambda {', '.join(short)}: {fn}({', '.join([f'c.scoped({bind})', *params])})"
        target = f"{', '.join(returns)}{',' if len(returns) == 1 else ''} = " if returns else ""
        self.line(indent, f"{target}pl.run_scoped(")
        self.line(indent, f"    {call},")
        tiles = set(self.k.kv.tile_buffers) if self.k.kv is not None else set()
        for b in step.buffers:
            # a KV tile holds a sequence's tokens: its batch dim counts sequences, not rows (as
            # mkc.checks.capacity.kernel_buffers sizes it)
            batch = "c.S" if b.name in tiles else "B"
            self.line(indent, f"    pltpu.VMEM({b.shape_expr(batch)}, {DTYPE_SOURCE[b.dtype]}),   # {b.name}")
        self.line(indent, ")")


def layer_source(s: ir.ScheduleIR, kind: str) -> str:
    """The body of `_layer_<kind>(k, layer)` (indented four spaces)."""
    return "\n".join(LayerEmitter(s, kind).emit())

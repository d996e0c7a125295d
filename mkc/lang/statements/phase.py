"""`phase KIND { ... }`: the statements that place copies, scopes and collectives in the
layers of one kind."""
from __future__ import annotations

from mkc.lang.ast import Phase
from mkc.lang.syntax import Builder, Meta, Placed, Syntax, empty_lists

SYNTAX = Syntax(r'''
phase_stmt: "phase" NAME "{" _phase_item* "}"
''')


@SYNTAX.statement("phase_stmt", "schedule", "phases", block=True)
def phase_stmt(b: Builder, meta: Meta, items: list) -> Phase:
    phase = Phase(b.name(items[0]), empty_lists("phase"), span=b.span(meta))
    for item in items[1:]:
        assert isinstance(item, Placed)
        phase.lists[item.statement.joins].append(item.node)
    return phase

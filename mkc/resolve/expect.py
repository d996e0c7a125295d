"""Pass `expect`: the headroom each `expect` line asks for, one per resource."""
from __future__ import annotations

from dataclasses import replace

from mkc import ir
from mkc.diagnostics import fail
from mkc.resolve.names import unknown
from mkc.resolve.state import ResolveState


def resolve_expect(s: ResolveState) -> ResolveState:
    expectations: dict[str, ir.Expectation] = {}
    for e in s.sched.expectations:
        what = e.resource.text
        if what not in ir.EXPECTABLE:
            raise unknown("resource to expect headroom of", e.resource, list(ir.EXPECTABLE))
        if what in expectations:
            raise fail("E-DUPLICATE", f"the {what} headroom is expected twice", e.span,
                       hint=f"keep one `expect {what}` line (the first is at line "
                            f"{expectations[what].span.line})")
        expectations[what] = ir.Expectation(what, e.at_least.value, e.span)
    return replace(s, expectations=tuple(expectations.values()))

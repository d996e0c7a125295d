"""The `fmt` target: `mkc fmt -` on the spec-text mutants keeps their meaning and comments, and
formatting its output again changes nothing."""
from __future__ import annotations

import difflib
import re
from pathlib import Path

from fuzz.cases import Case, split_lines
from fuzz.mutations import LINE_BREAKS


def _comment_texts(text: str) -> list[str]:
    """The comments as the grammar reads them (`#` to the line feed, outside strings), their
    trailing whitespace aside (fmt drops it)."""
    return [m.group().rstrip() for m in re.finditer(r'"[^"\n]*"|#[^\n]*', text)
            if m.group().startswith("#")]


def _fmt_failure(cls: str, what: str, text: str, a: str, b: str) -> dict:
    """A fmt failure: its signature (what differs, and whether the source has line breaks other
    than "\n", which lark and str.splitlines() count differently) and a diff."""
    odd = sorted({repr(c) for c in text if c in LINE_BREAKS})
    diff = [ln.rstrip("\n") for ln in difflib.unified_diff(split_lines(a), split_lines(b), n=0)][2:14]
    return {"cls": cls, "sig": f"{what}" + (" (odd line breaks in the source)" if odd else ""),
            "detail": (f"line breaks {' '.join(odd)}\n" if odd else "") + "\n".join(map(repr, diff))}


def run(case: Case, d: Path, res: dict) -> dict:
    """`mkc fmt -`: a spec the parser accepts formats to text that parses to the same AST with
    the same comments, and formatting that text again changes nothing."""
    from mkc.diagnostics import MkcError
    from mkc.lang import ast, parser
    from mkc.lang.fmt import format_text
    res["stage"] = "parse"
    sched, text = parser.parse_bytes(case.spec, "spec.sched")       # MkcError: a diagnostic
    res["stage"] = "fmt"
    once = format_text(text, "spec.sched")
    res["stage"] = "fmt again"
    try:
        again = parser.parse(once, "spec.sched")
    except MkcError as e:
        return {"cls": "fmt_changed_meaning", "sig": f"formatted text does not parse ({e.codes[0]})",
                "detail": str(e)[:400]}
    if ast.meaning(again) != ast.meaning(sched):
        return _fmt_failure("fmt_changed_meaning", "AST differs after fmt", text, text, once)
    if _comment_texts(once) != _comment_texts(text):
        before, after = _comment_texts(text), _comment_texts(once)
        return _fmt_failure("fmt_changed_meaning", "comments differ after fmt", text,
                            "\n".join(before) + "\n", "\n".join(after) + "\n")
    twice = format_text(once, "spec.sched")
    if twice != once:
        blank_only = [ln.strip() for ln in split_lines(once) if ln.strip()] == \
            [ln.strip() for ln in split_lines(twice) if ln.strip()]
        return _fmt_failure("fmt_unstable", "formatting its output again changes "
                            + ("blank lines" if blank_only else "text"), text, once, twice)
    return {"cls": "ok"}


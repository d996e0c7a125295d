"""Comments that quote the old slice's figures, on a spec moved to another slice.

`mkc.perf.comments` drops the comments of the statements a retarget rewrites. A comment of a
statement it keeps may still quote a figure the old slice produced: VMEM bytes, a modelled
step time or share, HBM. On the new slice those numbers are false, so the part of the comment
that states one goes: a parenthesis holding a figure, else the sentence holding it, else the
whole comment; the rest is kept and re-wrapped. Counts that are the spec's own ("1 anchor + 7
drafts", "tiles of 1024 x 640") carry no unit and stay.
"""
from __future__ import annotations

import re
import textwrap

from mkc.perf.comments import comment_start

# A number with a unit of bytes, time or share.
_FIGURE = re.compile(r"\d(?:[\d.,]*\d)?\s*(?:%|[KMGT]i?B\b|[KMG]B/s\b|ms\b|us\b|µs\b|ns\b)")
_PAREN = re.compile(r"\s*\([^()]*\)")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(\"'])")
_MIN_WIDTH = 60


def has_figure(text: str) -> bool:
    return bool(_FIGURE.search(text))


def without_figures(text: str) -> str:
    """`text` (a comment's prose) without its parentheses and sentences stating a figure;
    empty when nothing else is left."""
    text = _PAREN.sub(lambda m: "" if has_figure(m.group()) else m.group(), text)
    kept = [s for s in _SENTENCE_END.split(text) if not has_figure(s)]
    out = " ".join(kept).strip()
    return out if re.search(r"[A-Za-z]", out) else ""


def drop_old_figures(text: str, keep_above: int | None = None) -> str:
    """`text` with every comment's figures dropped (module docstring); the comment run above
    1-based line `keep_above` (the tool's own note) is left as it is."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip().startswith("#"):
            at = comment_start(line)
            if at is not None and has_figure(line[at:]):
                line = line[:at].rstrip()
            out.append(line)
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].strip().startswith("#"):
            j += 1
        run = lines[i:j]
        if keep_above == j + 1 or not any(has_figure(r) for r in run):
            out += run
        else:
            indent = run[0][:len(run[0]) - len(run[0].lstrip())]
            prose = " ".join(r.strip().lstrip("#").strip() for r in run)
            if kept := without_figures(prose):
                width = max(_MIN_WIDTH, max(len(r) for r in run))
                out += textwrap.wrap(kept, width, initial_indent=indent + "# ",
                                     subsequent_indent=indent + "# ")
        i = j
    return "\n".join(out)

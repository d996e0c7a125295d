"""Comments of the statements a tool rewrites (`mkc tune`, `mkc retarget`): the rule for
which go stale.

A comment belongs to a statement when it trails the statement on its line, or when it is the
run of comment lines directly above the statement, or above the consecutive statements of the
same keyword the statement is one of (the comment over eight `shard` lines is about all of
them); a statement inside a `pool` or `stream` block also owns the comment above the block's
header. When a tool changes a statement, each comment it owns that states a number (digits,
or a number word such as "two") is dropped: such comments quote the old layout's values and
modelled figures, which no longer hold. A comment with no number explains the statement's
purpose and is kept. A dropped comment can be replaced by one note line the tool writes.
"""
from __future__ import annotations

import re
import textwrap

WIDTH = 96                  # the shipped specs' comment width
_NUMBER = re.compile(r"\d|\b(one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|"
                     r"twice|half|double|single)\b", re.I)
# Blocks whose header owns the comment above it for the statements inside.
_CLIMB = ("pool", "stream")


def states_numbers(comment: str) -> bool:
    return bool(_NUMBER.search(comment))


def comment_start(line: str) -> int | None:
    """Where the line's comment starts (outside a string), or None."""
    quoted = False
    for i, ch in enumerate(line):
        if ch == '"':
            quoted = not quoted
        elif ch == "#" and not quoted:
            return i
    return None


def _keyword(line: str) -> str:
    words = line.split()
    return words[0] if words else ""


def _is_statement(line: str) -> bool:
    s = line.strip()
    return bool(s) and not s.startswith("#") and s != "}"


def _comment_run_above(lines: list[str], index: int) -> list[int]:
    """Indexes of the comment-only lines directly above line `index`."""
    out = []
    i = index - 1
    while i >= 0 and lines[i].strip().startswith("#"):
        out.append(i)
        i -= 1
    return out


def owned_comments(lines: list[str], index: int) -> tuple[list[int], bool]:
    """The comment-only lines (0-based indexes) statement line `index` owns, and whether its
    own line has a trailing comment (module docstring)."""
    trailing = comment_start(lines[index]) not in (None, len(lines[index]) - len(lines[index].lstrip()))
    keyword = _keyword(lines[index])
    i = index
    while i > 0 and _is_statement(lines[i - 1]) and _keyword(lines[i - 1]) == keyword \
            and not lines[i - 1].rstrip().endswith("{"):
        i -= 1
    owned = _comment_run_above(lines, i)
    if not owned and i > 0 and lines[i - 1].rstrip().endswith("{") \
            and _keyword(lines[i - 1]) in _CLIMB:
        owned = _comment_run_above(lines, i - 1)
    return sorted(owned), trailing


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _wrapped(note: str, indent: str) -> str:
    """A `# ...` note as comment lines at `indent`, none past `WIDTH` columns (a word longer
    than the line stays whole)."""
    body = textwrap.wrap(note.removeprefix("#").strip(), WIDTH - len(indent) - 2,
                         break_long_words=False, break_on_hyphens=False)
    return "\n".join(f"{indent}# {part}" for part in body)


def drop_stale_comments(text: str, changed: dict[int, str | None]) -> str:
    """`text` with the comments owned by the changed statements (1-based line numbers) dropped
    where they state numbers; a note given for a line (`changed[line]`) takes the place of its
    dropped comment lines, at their indent, wrapped (or is added above the statement, at its
    indent, when it owned none that were dropped). A changed line's trailing comment stating
    numbers goes too."""
    lines = text.split("\n")
    drop: set[int] = set()
    notes: dict[int, str] = {}            # 0-based line the note goes above
    for line_no, note in sorted(changed.items()):
        index = line_no - 1
        if not 0 <= index < len(lines) or not _is_statement(lines[index]):
            continue
        owned, trailing = owned_comments(lines, index)
        stale = [i for i in owned if states_numbers(lines[i])]
        if stale and len(stale) != len(owned):
            stale = owned                 # a paragraph goes as one: half of it reads wrong
        drop.update(stale)
        if trailing and states_numbers(lines[index][comment_start(lines[index]):]):
            lines[index] = lines[index][:comment_start(lines[index])].rstrip()
        if note:
            at = min(stale) if stale else index
            wrapped = _wrapped(note, _indent(lines[at]))
            notes[at] = notes[at] + "\n" + wrapped if at in notes else wrapped
    out = []
    for i, line in enumerate(lines):
        if i in notes:
            out.append(notes[i])
        if i not in drop:
            out.append(line)
    return "\n".join(out)

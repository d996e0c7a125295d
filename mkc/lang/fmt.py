"""`mkc fmt`: the canonical layout of a .sched spec, keeping every comment.

One statement a line, indented two spaces a block; single spaces between words, none before
`,` `;` `:` `)` or around `.`; the settings' keywords padded to one column (`model   "..."`,
`context 4096`) and `load` to `store`'s, as the shipped specs write them. Comments stay where
they are: a comment line above the statement (or the `}`) that follows it, at that line's
indent; a comment after a statement after it, two spaces out. One blank line is kept where the
source has one or more, never just inside a `{` or before a `}`. Formatting is idempotent and
changes no meaning: the formatted text parses to the same AST (tests check both).

It reads lark's own tokens (with the comments the parser ignores) and the parse tree's
statement positions, so it follows the grammar and never rewrites a spec it cannot parse.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

import lark

from mkc.diagnostics import source_lines
from mkc.lang import parser, syntax

INDENT = "  "
_NO_SPACE_BEFORE = {",", ";", ":", ")", ".", "("}
_NO_SPACE_AFTER = {".", "("}


@lru_cache(maxsize=1)
def _padded() -> tuple[tuple[tuple[str, ...], int], ...]:
    """Keywords padded to one column when they start a statement, with the column's width:
    the settings', and a copy's direction."""
    settings = tuple(s.keyword for s in syntax.statements() if s.setting)
    return ((settings, max(map(len, settings)) + 1), (("load", "store"), 6))


@lru_cache(maxsize=1)
def _blocks() -> set[str]:
    """Statements that open a block: their header runs to the `{`."""
    return {s.rule for s in syntax.statements() if s.block} | {"schedule"}


@dataclass(frozen=True)
class _Comment:
    line: int
    text: str
    trailing: bool        # after a token on its line


def format_text(text: str, file: str = "<spec>") -> str:
    """The canonical layout of `text`; raises mkc.diagnostics.MkcError where it does not parse."""
    parser.parse(text, file)                 # the located diagnostic for bad input
    tree = parser.lark_parser().parse(text)
    tokens = list(parser.lark_parser().lex(text, dont_ignore=True))
    words = [t for t in tokens if t.type not in ("WS", "COMMENT")]
    comments = _comments(tokens)
    out = _Writer(text, words, comments)
    out.block(tree.children[0], depth=0)
    out.rest()
    return "\n".join(out.lines).rstrip("\n") + "\n"


def _comments(tokens: list[lark.Token]) -> list[_Comment]:
    found, last_word_line = [], 0
    for t in tokens:
        if t.type == "COMMENT":
            found.append(_Comment(t.line, str(t).rstrip(), trailing=t.line == last_word_line))
        elif t.type != "WS":
            last_word_line = t.end_line
    return found


def _join(words: list[lark.Token]) -> str:
    """Tokens of one statement on one line, spaced canonically."""
    out = ""
    for i, w in enumerate(words):
        s = str(w)
        if i and s not in _NO_SPACE_BEFORE and str(words[i - 1]) not in _NO_SPACE_AFTER:
            out += " "
        out += s
    for keywords, width in _padded():
        first = str(words[0])
        if first in keywords and len(words) > 1:
            out = first.ljust(width - 1) + out[len(first):]
    return out


class _Writer:
    """Emits statements and the comments before them in source order."""

    def __init__(self, text: str, words: list[lark.Token], comments: list[_Comment]):
        self.source_lines, self.words, self.comments = source_lines(text), words, comments
        self.word_starts = [w.start_pos for w in words]     # in source order: bisected
        self.comment_lines = [c.line for c in comments]
        self.next_comment = 0                                # comments before it are emitted
        self.lines: list[str] = []
        self.done_line = 0          # the last source line emitted
        self.open_block = True      # no blank line right after a `{` (or at the file's start)

    def _words_in(self, start: int, end: int) -> list[lark.Token]:
        return self.words[bisect.bisect_left(self.word_starts, start):
                          bisect.bisect_left(self.word_starts, end)]

    def _blank_before(self, line: int) -> None:
        """One blank line if the source has one between the last emitted line and `line`."""
        between = self.source_lines[self.done_line:line - 1]
        if not self.open_block and any(not s.strip() for s in between):
            self.lines.append("")

    def _take_comments(self, before_line: int) -> list[_Comment]:
        """The comments not yet emitted that sit before source line `before_line` (they come
        in source order, so always a prefix of what is left)."""
        end = bisect.bisect_left(self.comment_lines, before_line, lo=self.next_comment)
        taken, self.next_comment = self.comments[self.next_comment:end], end
        return taken

    def _leading(self, line: int, depth: int) -> None:
        """The comment lines before source line `line`, at `depth`."""
        for c in self._take_comments(line):
            self._blank_before(c.line)
            self.lines.append(INDENT * depth + c.text)
            self.done_line, self.open_block = c.line, False

    def _line(self, first_line: int, last_line: int, depth: int, text: str) -> None:
        self._leading(first_line, depth)
        self._blank_before(first_line)
        # trailing comments of the statement's lines (a comment line inside it moves above)
        inner = self._take_comments(last_line + 1)
        above = [c.text for c in inner if not c.trailing or c.line < last_line]
        after = [c.text for c in inner if c.trailing and c.line == last_line]
        self.lines += [INDENT * depth + c for c in above]
        self.lines.append(INDENT * depth + text + "".join("  " + c for c in after))
        self.done_line, self.open_block = last_line, False

    def statement(self, node: lark.Tree, depth: int) -> None:
        if getattr(node, "data", None) in _blocks():
            return self.block(node, depth)
        words = self._words_in(node.meta.start_pos, node.meta.end_pos)
        self._line(words[0].line, words[-1].end_line, depth, _join(words))

    def block(self, node: lark.Tree, depth: int) -> None:
        children = [c for c in node.children if isinstance(c, lark.Tree)]
        body_start = children[0].meta.start_pos if children else node.meta.end_pos
        header = self._words_in(node.meta.start_pos, body_start)
        header = header[:[str(w) for w in header].index("{") + 1]
        self._line(header[0].line, header[-1].end_line, depth, _join(header))
        self.open_block = True
        for child in children:
            self.statement(child, depth + 1)
        close = self._words_in(node.meta.end_pos - 1, node.meta.end_pos)[0]
        self._leading(close.line, depth + 1)
        self.open_block = True            # no blank line before a `}`
        self._line(close.line, close.line, depth, "}")

    def rest(self) -> None:
        """Comments after the schedule's closing brace."""
        self._leading(len(self.source_lines) + 2, 0)

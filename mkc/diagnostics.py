"""Source spans and user-facing diagnostics (file:line:col, excerpt with caret, hint)."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field


def did_you_mean(word: str, options: list[str]) -> str:
    """The start of a hint naming the option closest to a mistyped `word`, or ""."""
    close = difflib.get_close_matches(word, options, n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def source_lines(text: str) -> list[str]:
    """A spec's lines as its parser numbers them. The lexer counts only '\n' as a line break
    ('\r' and '\f' are whitespace to it, and a comment runs to the '\n' over any '\r',
    '\v', '\u2028' ...), so `str.splitlines()`, which breaks at all of those, would number
    lines differently. Like splitlines, a final '\n' ends the last line rather than starting
    an empty one, and a line's trailing '\r' (CRLF files) is not part of its text."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


@dataclass(frozen=True)
class Span:
    """A region of a source file; lines and columns are 1-based."""

    file: str
    line: int
    column: int
    end_line: int
    end_column: int

    @staticmethod
    def unknown(file: str = "<spec>") -> "Span":
        return Span(file, 1, 1, 1, 1)


@dataclass
class Diagnostic:
    """One problem in a spec: where, what, and how to fix it."""

    code: str          # stable identifier, e.g. "E-SYNTAX", "E-VMEM-CAPACITY"
    message: str
    span: Span
    hint: str = ""
    notes: list[str] = field(default_factory=list)

    def render(self, source: str | None) -> str:
        loc = f"{self.span.file}:{self.span.line}:{self.span.column}"
        out = [f"{loc}: error[{self.code}]: {self.message}"]
        if source is not None:
            lines = source_lines(source)
            if 1 <= self.span.line <= len(lines):
                text = lines[self.span.line - 1]
                gutter = f"{self.span.line:>5} | "
                out.append(gutter + text)
                width = 1
                if self.span.end_line == self.span.line and self.span.end_column > self.span.column:
                    width = self.span.end_column - self.span.column
                out.append(" " * (len(gutter) + self.span.column - 1) + "^" * width)
        for note in self.notes:
            out.append(f"  note: {note}")
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)


class MkcError(Exception):
    """Raised by any stage with one or more diagnostics; the CLI renders them and exits 1."""

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic):
        self.diagnostics = diagnostics if isinstance(diagnostics, list) else [diagnostics]
        super().__init__("; ".join(d.message for d in self.diagnostics))

    @property
    def codes(self) -> list[str]:
        return [d.code for d in self.diagnostics]

    def render(self, source: str | None) -> str:
        return "\n\n".join(d.render(source) for d in self.diagnostics)


def fail(code: str, message: str, span: Span, hint: str = "", notes: list[str] | None = None) -> MkcError:
    """Build (not raise) an error with a single diagnostic: `raise fail(...)`."""
    return MkcError(Diagnostic(code, message, span, hint, list(notes or [])))


def diagnostic_json(d: Diagnostic) -> dict:
    """A diagnostic as `--json` prints it."""
    return {"code": d.code, "file": d.span.file, "line": d.span.line, "column": d.span.column,
            "end_line": d.span.end_line, "end_column": d.span.end_column, "message": d.message,
            "hint": d.hint, "notes": list(d.notes)}

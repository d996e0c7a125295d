"""`mkc lsp`: a language server for .sched specs over stdio (pygls).

What an editor gets while a spec is written:
- diagnostics as you type: the checks `mkc check` runs (syntax, resolve, capacity, DMA
  hazards, scopes), each with its code, span and hint; a problem in another file (the model's
  config.json) is shown at the `model` line with that file named;
- hover on a buffer: its class, shape, dtype and VMEM bytes at the widest kernel; on a
  statement inside a phase: the VMEM live at that program point against the budget;
- go to definition of buffers (where the spec makes them), phases, rings, streams and views;
- completion of the language's keywords and the spec's buffer names;
- formatting: `mkc fmt`'s canonical layout.

Hover and definition read the last analysis that passed the checks, so they keep working
while the text is mid-edit (positions may then be a few characters off until it checks
again).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from lsprotocol import types
from pygls.lsp.server import LanguageServer

import mkc
from mkc.diagnostics import Diagnostic, MkcError, Span, source_lines

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MIB = 1 << 20


@dataclass
class Analysis:
    """What the server knows of one document: its diagnostics and, once it checks, the IR, the
    checked trace and the names it defines (name -> span)."""

    diagnostics: list[Diagnostic]
    compiled: object | None = None             # mkc.compiler.Compiled
    definitions: dict[str, Span] = field(default_factory=dict)
    phase_lines: list[tuple[str, int, int]] = field(default_factory=list)   # kind, first, last

    def name_at(self, word: str | None, line: int) -> str | None:
        """The defined name `word` means at 1-based `line`: inside `phase K`, a buffer the
        phase makes is `K_word` in the IR."""
        for kind, first, last in self.phase_lines:
            if first <= line <= last and f"{kind}_{word}" in self.definitions:
                return f"{kind}_{word}"
        return word


def analyse(text: str, path: str) -> Analysis:
    """Check `text` as the spec at `path` (no file is read but the model's config)."""
    from mkc import compiler
    try:
        c = compiler.check_source(text, path)
    except MkcError as e:
        return Analysis(e.diagnostics)
    sched = c.schedule
    phases = [(p.kind.text, p.span.line, p.span.end_line) for p in sched.phases]
    return Analysis([], c, _definitions(sched, c.ir), phases)


def _definitions(sched, schedule_ir) -> dict[str, Span]:
    """Where the spec defines each name: rings, parities, pools and their views, phases (by
    kind), and buffers (where the spec makes them)."""
    named = [*sched.rings, *sched.parities, *sched.pools, *[v for p in sched.pools for v in p.views]]
    found = {n.name.text: n.name.span for n in named}
    found |= {p.kind.text: p.kind.span for p in sched.phases}
    for b in schedule_ir.buffers:
        if b.span != Span.unknown(b.span.file):
            found.setdefault(b.name, b.span)
    return found


def _range(span: Span) -> types.Range:
    end_line, end_col = span.end_line, span.end_column
    if (end_line, end_col) <= (span.line, span.column):
        end_line, end_col = span.line, span.column + 1
    return types.Range(start=types.Position(line=span.line - 1, character=span.column - 1),
                       end=types.Position(line=end_line - 1, character=end_col - 1))


def lsp_diagnostic(d: Diagnostic, path: str, model_span: Span | None) -> types.Diagnostic:
    """An mkc diagnostic for the editor; one located in another file (the model's config)
    sits at the spec's `model` line and names that file."""
    message, span = d.message, d.span
    if Path(span.file) != Path(path):
        message = f"{span.file}:{span.line}:{span.column}: {message}"
        span = model_span or Span.unknown(path)
    if d.hint:
        message += f"\nhint: {d.hint}"
    if d.notes:
        message += "\n" + "\n".join(f"note: {n}" for n in d.notes)
    return types.Diagnostic(range=_range(span), message=message, code=d.code, source="mkc",
                            severity=types.DiagnosticSeverity.Error)


def _model_span(text: str, path: str) -> Span | None:
    for i, line in enumerate(source_lines(text), start=1):
        m = re.match(r"\s*model\b", line)
        if m:
            return Span(path, i, m.end() - 4, i, len(line.rstrip()) + 1)
    return None


def word_at(text: str, line: int, character: int) -> str | None:
    """The name under a 0-based (line, character) position."""
    lines = text.splitlines()
    if not 0 <= line < len(lines):
        return None
    for m in _WORD.finditer(lines[line]):
        if m.start() <= character <= m.end():
            return m.group()
    return None


def hover_text(analysis: Analysis, word: str | None, line: int) -> str | None:
    """Markdown for a hover at 1-based `line`: the buffer named, and the VMEM live at the
    program point the line's statement sits at."""
    c = analysis.compiled
    if c is None:
        return None
    parts = []
    word = analysis.name_at(word, line)
    buffer = next((b for b in c.ir.buffers if b.name == word), None)
    if buffer is not None:
        b = buffer.at_batch(c.ir.rows_max)
        scope = f", scoped in `{b.scope[0]}`" if b.scope else ", kernel lifetime"
        parts.append(f"**{b.name}**: {b.cls} buffer {list(b.shape)} {b.dtype}, "
                     f"{b.vmem_bytes / MIB:.2f} MiB of VMEM at {c.ir.rows_max} rows{scope}")
    point = vmem_at_line(c, line)
    if point:
        parts.append(point)
    return "\n\n".join(parts) or None


def vmem_at_line(c, line: int) -> str | None:
    """The VMEM live where the statement at `line` acts (its first event in the checked
    trace), at the widest kernel, against the budget."""
    from mkc.checks.capacity import vmem_budget_bytes, vmem_timeline
    first = next((e for e in c.events if e.span.line == line), None)
    if first is None:
        return None
    points = [(e.seq if e else -1, total) for e, total, _ in vmem_timeline(c.ir, c.events)]
    here = [total for seq, total in points if seq <= first.seq][-1]
    peak = max(total for _, total in points)
    return (f"VMEM live here ({first.where}): {here / MIB:.2f} MiB at {c.ir.rows_max} rows; "
            f"peak {peak / MIB:.2f} MiB of the {vmem_budget_bytes(c.ir) / MIB:.2f} MiB budget")


def keywords() -> list[str]:
    """The language's keywords, from its grammar."""
    from mkc.lang import parser
    return sorted({t.pattern.value for t in parser._parser().terminals
                   if t.pattern.type == "str" and t.pattern.value.isalpha()})


def _path(uri: str) -> str:
    parsed = urlparse(uri)
    return unquote(parsed.path) if parsed.scheme == "file" else uri


def build_server() -> LanguageServer:
    server = LanguageServer("mkc", mkc.__version__)
    docs: dict[str, Analysis] = {}          # uri -> the last analysis that checked

    def check(ls: LanguageServer, uri: str) -> None:
        doc = ls.workspace.get_text_document(uri)
        path = _path(uri)
        analysis = analyse(doc.source, path)
        if analysis.compiled is not None:
            docs[uri] = analysis
        span = _model_span(doc.source, path)
        ls.text_document_publish_diagnostics(types.PublishDiagnosticsParams(
            uri=uri, version=doc.version,
            diagnostics=[lsp_diagnostic(d, path, span) for d in analysis.diagnostics]))

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: LanguageServer, params: types.DidOpenTextDocumentParams) -> None:
        check(ls, params.text_document.uri)

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: LanguageServer, params: types.DidChangeTextDocumentParams) -> None:
        check(ls, params.text_document.uri)

    @server.feature(types.TEXT_DOCUMENT_HOVER)
    def hover(ls: LanguageServer, params: types.HoverParams) -> types.Hover | None:
        uri, pos = params.text_document.uri, params.position
        text = ls.workspace.get_text_document(uri).source
        found = hover_text(docs.get(uri, Analysis([])), word_at(text, pos.line, pos.character),
                           pos.line + 1)
        if not found:
            return None
        return types.Hover(contents=types.MarkupContent(kind=types.MarkupKind.Markdown, value=found))

    @server.feature(types.TEXT_DOCUMENT_DEFINITION)
    def definition(ls: LanguageServer, params: types.DefinitionParams) -> types.Location | None:
        uri, pos = params.text_document.uri, params.position
        word = word_at(ls.workspace.get_text_document(uri).source, pos.line, pos.character)
        analysis = docs.get(uri, Analysis([]))
        span = analysis.definitions.get(analysis.name_at(word, pos.line + 1) or "")
        return types.Location(uri=uri, range=_range(span)) if span else None

    @server.feature(types.TEXT_DOCUMENT_COMPLETION)
    def completion(ls: LanguageServer, params: types.CompletionParams) -> types.CompletionList:
        c = docs.get(params.text_document.uri, Analysis([])).compiled
        items = [types.CompletionItem(label=k, kind=types.CompletionItemKind.Keyword) for k in keywords()]
        items += [types.CompletionItem(label=b.name, kind=types.CompletionItemKind.Variable,
                                       detail=f"{b.cls} buffer")
                  for b in (c.ir.buffers if c else ())]
        return types.CompletionList(is_incomplete=False, items=items)

    @server.feature(types.TEXT_DOCUMENT_FORMATTING)
    def formatting(ls: LanguageServer, params: types.DocumentFormattingParams
                   ) -> list[types.TextEdit] | None:
        from mkc.lang.fmt import format_text
        text = ls.workspace.get_text_document(params.text_document.uri).source
        try:
            formatted = format_text(text)
        except MkcError:
            return None                  # the diagnostics already say why
        if formatted == text:
            return []
        end = types.Position(line=len(text.splitlines()) + 1, character=0)
        return [types.TextEdit(range=types.Range(start=types.Position(line=0, character=0), end=end),
                               new_text=formatted)]

    return server


def main() -> int:
    build_server().start_io()
    return 0

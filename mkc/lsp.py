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

Analyses run on a worker thread ANALYSIS_DELAY_S after a document's last change, on its newest
text only, so requests never wait for one; a text over the parser's size limit gets that one
diagnostic. Every request is answered: a frame that cannot be read, or params that do not fit
the method, get their JSON-RPC error, and the frames after them are read as usual; a document
the editor has not opened is never read from disk.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import itertools
import json
import logging
import re
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlparse

from cattrs import transform_error
from cattrs.errors import ClassValidationError
from lsprotocol import types
from lsprotocol.types import ResponseErrorMessage
from pygls.exceptions import (JsonRpcContentModified, JsonRpcException, JsonRpcInternalError,
                              JsonRpcInvalidParams, JsonRpcInvalidRequest, JsonRpcParseError,
                              JsonRpcServerNotInitialized)
from pygls.io_ import StdoutWriter
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.json_rpc import JsonRPCNotification, JsonRPCRequestMessage, JsonRPCResponseMessage
from pygls.workspace import TextDocument

import mkc
from mkc import compiler
from mkc.checks.capacity import vmem_budget_bytes, vmem_timeline
from mkc.diagnostics import Diagnostic, MkcError, Span, source_lines
from mkc.lang import parser
from mkc.lang.fmt import format_text

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
        parts.append(f"**{b.label}**: {b.cls} buffer {list(b.shape)} {b.dtype}, "
                     f"{b.vmem_bytes / MIB:.2f} MiB of VMEM at {c.ir.rows_max} rows{scope}")
    point = vmem_at_line(c, line)
    if point:
        parts.append(point)
    return "\n\n".join(parts) or None


def vmem_at_line(c, line: int) -> str | None:
    """The VMEM live where the statement at `line` acts (its first event in the checked
    trace), at the widest kernel, against the budget."""
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
    return sorted({t.pattern.value for t in parser._parser().terminals
                   if t.pattern.type == "str" and t.pattern.value.isalpha()})


def _path(uri: str) -> str:
    parsed = urlparse(uri)
    return unquote(parsed.path) if parsed.scheme == "file" else uri


# ---- transport: every frame gets read, every request an answer ------------------------------

MAX_FRAME_BYTES = 64 * MIB       # a message longer than this is refused unread
_LINE_BYTES = MIB                # header lines (and bytes skipped between frames) are read in pieces
_CONTENT_LENGTH = b"content-length:"
logger = logging.getLogger(__name__)


def _frame_length(value: bytes | None) -> int | str:
    """The body length a header block's Content-Length value gives, or why there is none."""
    if value is None:
        return "a frame without a Content-Length header"
    if not value.isdigit():
        return f"Content-Length {value[:40].decode(errors='replace')!r} is not a number of bytes"
    if int(value) > MAX_FRAME_BYTES:
        return f"a frame of {int(value)} bytes is over the {MAX_FRAME_BYTES // MIB} MiB a message may have"
    return int(value)


def read_frames(stdin: BinaryIO, on_body: Callable[[bytes], None], on_bad_frame: Callable[[str], None]
                ) -> None:
    """Split `stdin` into frames until it ends: header lines up to an empty line, one of them
    `Content-Length: N`, then N bytes of body. A header block without a valid length is reported
    (`on_bad_frame`) and the bytes after it are skipped up to the next `Content-Length:` header
    (bytes before that header on its line are the unread rest of the bad frame), so no input
    leaves the reader out of step with the frames that follow."""
    length: bytes | None = None          # the Content-Length value of the block so far
    while line := stdin.readline(_LINE_BYTES):
        if (at := line.lower().rfind(_CONTENT_LENGTH)) >= 0:
            # a length header starts a block (the line's last: skipped bytes may hold the words)
            length = line[at + len(_CONTENT_LENGTH):].strip()
        elif not line.strip():
            body_length, length = _frame_length(length), None
            if isinstance(body_length, str):
                on_bad_frame(body_length)
                continue
            body = stdin.read(body_length)
            if len(body) < body_length:
                return
            on_body(body)


_MESSAGE = ('an object with "jsonrpc": "2.0", a string "method" and, for a request, an integer or '
            'string "id"')


def _valid_id(msg_id: object) -> bool:
    return isinstance(msg_id, (int, str)) and not isinstance(msg_id, bool)


class _Protocol(LanguageServerProtocol):
    """pygls' LSP protocol, handed whole frame bodies by `read_frames`: a body that is not a
    JSON-RPC message, or a request whose params do not fit its method, is answered with its
    JSON-RPC error (id null where the id cannot be read) instead of being logged and dropped."""

    def answer_error(self, msg_id: int | str | None, error: JsonRpcException) -> None:
        if msg_id is None:            # JSON-RPC's id null, which pygls' serializer would omit
            self._send_data({"jsonrpc": "2.0", "id": None,
                             "error": {"code": error.code, "message": error.message}})
        else:
            self._send_response(msg_id, error=error.to_response_error())

    def handle_body(self, body: bytes) -> None:
        try:
            data = json.loads(body)
        except ValueError as e:
            return self.answer_error(None, JsonRpcParseError(f"the frame's body is not JSON: {e}"))
        except RecursionError:
            return self.answer_error(None, JsonRpcParseError("the frame's body is nested too deeply"))
        if not isinstance(data, dict):
            return self.answer_error(None, JsonRpcInvalidRequest(f"not a JSON-RPC message: {_MESSAGE}"))
        msg_id = data.get("id") if _valid_id(data.get("id")) else None
        if "method" not in data and "id" in data:            # a response to a request of the server's
            if data.get("jsonrpc") != "2.0" or msg_id is None:
                return logger.warning("dropped a response that is not JSON-RPC 2.0 with a valid id")
        elif data.get("jsonrpc") != "2.0" or not isinstance(data.get("method"), str) \
                or ("id" in data and msg_id is None):
            return self.answer_error(msg_id, JsonRpcInvalidRequest(f"not a JSON-RPC 2.0 message: {_MESSAGE}"))
        is_request = "method" in data and "id" in data
        try:
            message = self.structure_message(data)
        except JsonRpcException as e:
            if is_request:
                self.answer_error(data["id"], e)
            else:
                logger.warning("dropped %s: %s", data.get("method", "a response"), e.message)
            return
        if is_request and self._shutdown and data["method"] != types.EXIT:
            return self.answer_error(data["id"], JsonRpcInvalidRequest("the server is shut down"))
        if is_request and self._workspace is None and data["method"] != types.INITIALIZE:
            return self.answer_error(data["id"], JsonRpcServerNotInitialized(
                "the server is not initialized: send `initialize` first"))
        self.handle_message(message)

    def structure_message(self, data: dict) -> object:
        """The typed message `data` is (pygls' own logs a traceback and loses the request's id)."""
        if "method" in data:
            kind = self.get_message_type(data["method"]) or (
                JsonRPCRequestMessage if "id" in data else JsonRPCNotification)
        elif "error" in data:
            kind = ResponseErrorMessage
        else:
            kind = self._result_types.pop(data["id"], None) or JsonRPCResponseMessage
        try:
            return self._converter.structure(data, kind)
        except Exception as e:
            what = "; ".join(transform_error(e)) if isinstance(e, ClassValidationError) else str(e)
            raise JsonRpcInvalidParams(f"invalid params for {data.get('method', 'a response')}: {what}"
                                       ) from None


class _Server(LanguageServer):
    def start_io(self, stdin: BinaryIO | None = None, stdout: BinaryIO | None = None) -> None:
        """Serve over stdio, with `read_frames` splitting the input on its own thread."""
        self.protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
        try:
            asyncio.run(self._serve(stdin or sys.stdin.buffer))
        except BrokenPipeError:
            logger.error("the client closed the connection")
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            self.shutdown()

    async def _serve(self, stdin: BinaryIO) -> None:
        loop, ended = asyncio.get_running_loop(), asyncio.Event()

        def on_loop(handle: Callable, *args) -> None:
            try:
                loop.call_soon_threadsafe(handle, *args)
            except RuntimeError:
                pass                              # the loop has ended (after `exit`)

        def read() -> None:
            try:
                read_frames(stdin, lambda body: on_loop(self.protocol.handle_body, body),
                            lambda why: on_loop(self.protocol.answer_error, None, JsonRpcParseError(why)))
            finally:
                on_loop(ended.set)
        threading.Thread(target=read, name="mkc-lsp-stdin", daemon=True).start()
        await ended.wait()


def _answering(handler: Callable) -> Callable:
    """`handler`, raising a JSON-RPC error for whatever it raises: pygls would put the traceback
    in the answer (and on stderr)."""
    def error(e: Exception) -> JsonRpcException:
        if isinstance(e, JsonRpcException):
            return e
        return JsonRpcInternalError(f"mkc lsp failed: {type(e).__name__}: {e}")

    if inspect.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def guarded(*args):
            try:
                return await handler(*args)
            except Exception as e:
                raise error(e) from None
    else:
        @functools.wraps(handler)
        def guarded(*args):
            try:
                return handler(*args)
            except Exception as e:
                raise error(e) from None
    return guarded


# ---- analyses: off the message loop, newest text only ---------------------------------------

ANALYSIS_DELAY_S = 0.2           # after a document's last change: typing queues no analysis per key


class Analyses:
    """The open documents' analyses, run on one worker thread so that no request waits for one.
    A change schedules an analysis of the document's text ANALYSIS_DELAY_S later; one whose
    document changed again before it started is skipped, and one that finishes after a newer
    change is dropped, so only the newest text is analysed and published."""

    def __init__(self, server: LanguageServer):
        self.server = server
        self.checked: dict[str, Analysis] = {}      # uri -> its last analysis that checked
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mkc-lsp-analysis")
        self._changes: dict[str, int] = {}          # uri -> the number of its newest change
        self._count = itertools.count(1)             # changes numbered across documents and reopenings
        self._pending: set[asyncio.Task] = set()

    def changed(self, uri: str, delay: float = ANALYSIS_DELAY_S) -> None:
        change = self._changes[uri] = next(self._count)
        task = asyncio.get_running_loop().create_task(self._analyse(uri, change, delay))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def closed(self, uri: str) -> None:
        self._changes.pop(uri, None)
        self.checked.pop(uri, None)

    def _newest(self, uri: str, change: int) -> bool:
        return self._changes.get(uri) == change

    async def _analyse(self, uri: str, change: int, delay: float) -> None:
        await asyncio.sleep(delay)
        doc = open_document(self.server, uri)
        if doc is None or not self._newest(uri, change):
            return
        version = doc.version
        done = await asyncio.get_running_loop().run_in_executor(self.worker, self._run, uri, change,
                                                                doc.source)
        if done is None or not self._newest(uri, change):
            return
        analysis, diagnostics = done
        if analysis.compiled is not None:
            self.checked[uri] = analysis
        self.server.text_document_publish_diagnostics(types.PublishDiagnosticsParams(
            uri=uri, version=version, diagnostics=diagnostics))

    def _run(self, uri: str, change: int, text: str) -> tuple[Analysis, list[types.Diagnostic]] | None:
        if not self._newest(uri, change):
            return None                           # superseded while it waited for the worker
        path = _path(uri)
        try:
            analysis = analyse(text, path)
        except Exception as e:                  # a bug in mkc: said where the editor shows it
            analysis = Analysis([Diagnostic("E-INTERNAL", f"mkc failed checking this text: "
                                            f"{type(e).__name__}: {e}", Span.unknown(path),
                                            hint="this is a bug in mkc; please report it with the spec")])
        span = _model_span(text, path)
        return analysis, [lsp_diagnostic(d, path, span) for d in analysis.diagnostics]


def open_document(server: LanguageServer, uri: str) -> TextDocument | None:
    """The document the editor opened at `uri`; None for any other (pygls would read it from
    disk)."""
    return server.workspace.text_documents.get(unquote(uri))


def build_server() -> LanguageServer:
    server = _Server("mkc", mkc.__version__, protocol_cls=_Protocol)
    analyses = Analyses(server)

    def feature(name: str):
        return lambda handler: server.feature(name)(_answering(handler))

    @feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: LanguageServer, params: types.DidOpenTextDocumentParams) -> None:
        analyses.changed(params.text_document.uri, delay=0)

    @feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: LanguageServer, params: types.DidChangeTextDocumentParams) -> None:
        analyses.changed(params.text_document.uri)

    @feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: LanguageServer, params: types.DidCloseTextDocumentParams) -> None:
        analyses.closed(params.text_document.uri)
        ls.text_document_publish_diagnostics(types.PublishDiagnosticsParams(
            uri=params.text_document.uri, diagnostics=[]))

    @feature(types.TEXT_DOCUMENT_HOVER)
    def hover(ls: LanguageServer, params: types.HoverParams) -> types.Hover | None:
        uri, pos = params.text_document.uri, params.position
        doc = open_document(ls, uri)
        if doc is None:
            return None
        found = hover_text(analyses.checked.get(uri, Analysis([])),
                           word_at(doc.source, pos.line, pos.character), pos.line + 1)
        if not found:
            return None
        return types.Hover(contents=types.MarkupContent(kind=types.MarkupKind.Markdown, value=found))

    @feature(types.TEXT_DOCUMENT_DEFINITION)
    def definition(ls: LanguageServer, params: types.DefinitionParams) -> types.Location | None:
        uri, pos = params.text_document.uri, params.position
        doc = open_document(ls, uri)
        if doc is None:
            return None
        word = word_at(doc.source, pos.line, pos.character)
        analysis = analyses.checked.get(uri, Analysis([]))
        span = analysis.definitions.get(analysis.name_at(word, pos.line + 1) or "")
        return types.Location(uri=uri, range=_range(span)) if span else None

    @feature(types.TEXT_DOCUMENT_COMPLETION)
    def completion(ls: LanguageServer, params: types.CompletionParams) -> types.CompletionList:
        c = analyses.checked.get(params.text_document.uri, Analysis([])).compiled
        items = [types.CompletionItem(label=k, kind=types.CompletionItemKind.Keyword) for k in keywords()]
        items += [types.CompletionItem(label=b.name, kind=types.CompletionItemKind.Variable,
                                       detail=f"{b.cls} buffer")
                  for b in (c.ir.buffers if c else ())]
        return types.CompletionList(is_incomplete=False, items=items)

    @feature(types.TEXT_DOCUMENT_FORMATTING)
    async def formatting(ls: LanguageServer, params: types.DocumentFormattingParams
                         ) -> list[types.TextEdit] | None:
        doc = open_document(ls, params.text_document.uri)
        if doc is None:
            return None
        text = doc.source
        try:             # on the analyses' worker: a long text takes a while to parse
            formatted = await asyncio.get_running_loop().run_in_executor(analyses.worker, format_text, text)
        except MkcError:
            return None                  # the diagnostics already say why
        if open_document(ls, params.text_document.uri) is not doc or doc.source != text:
            raise JsonRpcContentModified("the document changed while it was formatted")
        if formatted == text:
            return []
        end = types.Position(line=len(text.splitlines()) + 1, character=0)
        return [types.TextEdit(range=types.Range(start=types.Position(line=0, character=0), end=end),
                               new_text=formatted)]

    return server


class _OneLineLog(logging.Formatter):
    """A log record on one line, without its traceback: the server's stderr is the editor's log,
    and a request that fails is answered with its error."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
        return f"mkc lsp: {record.levelname.lower()}: {' '.join(message.split())}"[:500]


def main() -> int:
    log = logging.StreamHandler(sys.stderr)
    log.setFormatter(_OneLineLog())
    logging.basicConfig(level=logging.WARNING, handlers=[log], force=True)
    build_server().start_io()
    return 0

"""`mkc lsp`: a language server for .sched specs over stdio (pygls).

What an editor gets while a spec is written:
- diagnostics as you type: the checks `mkc check` runs (syntax, resolve, capacity, DMA
  hazards, scopes), each with its code, span and hint; a problem in another file (the model's
  config.json) is shown at the `model` line with that file named;
- hover on a buffer: its class, shape, dtype and VMEM bytes at the widest kernel; on a
  statement inside a phase: the VMEM live at that program point against the budget; on a
  keyword: the statement's description and grammar, from its module in mkc/lang/statements;
- go to definition of buffers (where the spec makes them), phases, rings, pools and views;
- completion by the grammar's context at the cursor: the keywords that may stand there, and
  where a name goes, the names a spec may write there (the model's ops after `before` /
  `after`, its states after `state.`, the phase's buffers in a `load` / `store` / `scoped`,
  layer kinds where a kind goes, generations after `target`), never an IR-internal name;
- formatting: `mkc fmt`'s canonical layout.

While the text has an error, hover and definition answer from the last text that parsed
(definitions) and the last that checked (buffers, VMEM), their lines mapped onto the current
text where it kept them; completion needs no parse of the whole text (the grammar context of
the cursor's statement, the model's names of the last text that resolved them).

Analyses run on a worker thread ANALYSIS_DELAY_S after a document's last change, on its newest
text only, so requests never wait for one; a text over the parser's size limit gets that one
diagnostic. Every request is answered: a frame that cannot be read, or params that do not fit
the method, get their JSON-RPC error, and the frames after them are read as usual; a document
the editor has not opened is never read from disk. `exit` ends the process at once, with status
0 after `shutdown` and 1 without (an analysis under way is not waited for).
"""
from __future__ import annotations

import asyncio
import difflib
import functools
import importlib
import inspect
import io
import itertools
import json
import logging
import os
import re
import selectors
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
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
from pygls.protocol.language_server import lsp_method
from pygls.protocol.json_rpc import JsonRPCNotification, JsonRPCRequestMessage, JsonRPCResponseMessage
from pygls.workspace import TextDocument

import mkc
from mkc import compiler
from mkc import target as targets
from mkc.checks.capacity import vmem_budget_bytes, vmem_timeline
from mkc.diagnostics import Diagnostic, MkcError, Span, source_lines
from mkc.lang import ast, parser, syntax
from mkc.lang.fmt import format_text

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MIB = 1 << 20


@dataclass(frozen=True)
class ModelNames:
    """The names of the model a spec runs that a spec may write: the layer kinds it runs, and
    each kind's ops (program points) and state families (`state.NAME`)."""

    layer_kinds: tuple[str, ...]
    ops: dict[str, list[str]]
    states: dict[str, list[str]]


@dataclass
class Analysis:
    """What the server knows of one text: its diagnostics; once it parses, the AST and the
    names it defines (name -> span; a phase's buffer as `KIND_name`, as in the IR); once it
    resolves through the model's graph, the model's names; once it checks, the IR and trace."""

    diagnostics: list[Diagnostic]
    compiled: object | None = None             # mkc.compiler.Compiled
    definitions: dict[str, Span] = field(default_factory=dict)
    text: str = ""
    sched: ast.Schedule | None = None
    model: ModelNames | None = None


def analyse(text: str, path: str) -> Analysis:
    """Check `text` as the spec at `path` (no file is read but the model's config)."""
    try:
        sched = parser.parse(text, path)
    except MkcError as e:
        return Analysis(e.diagnostics, text=text)
    found = Analysis([], text=text, sched=sched, definitions=_definitions(sched),
                     model=model_names(sched))
    try:
        found.compiled = compiler.check_source(text, path)
    except MkcError as e:
        found.diagnostics = e.diagnostics
        return found
    for b in found.compiled.ir.buffers:          # buffers the spec makes without naming them
        if b.span != Span.unknown(b.span.file):
            found.definitions.setdefault(b.name, b.span)
    return found


def model_names(sched: ast.Schedule) -> ModelNames | None:
    """The model's names, from resolve up to its graph; None where that does not resolve."""
    from mkc.resolve import resolve_state
    from mkc.resolve.phases import state_tensors
    try:
        st = resolve_state(sched, after="graph", suggest=False)
    except MkcError:
        return None
    kinds = st.graph.kinds
    return ModelNames(tuple(dict.fromkeys(st.dims.layer_kinds)),
                      {k: kind.op_names() for k, kind in kinds.items()},
                      {k: sorted(state_tensors(kind)) for k, kind in kinds.items()})


def _definitions(sched: ast.Schedule) -> dict[str, Span]:
    """Where the parsed spec defines each name: rings, parities, pools and their views, phases
    (by kind), and a phase's buffers (`KIND_name`, at its `scoped` line, else its first load)."""
    named = [*sched.rings, *sched.parities, *sched.pools, *[v for p in sched.pools for v in p.views]]
    found = {n.name.text: n.name.span for n in named}
    found |= {p.kind.text: p.kind.span for p in sched.phases}
    for p in sched.phases:
        made = [n for sc in p.scoped for n in sc.buffers]
        made += [b.dst for tr in p.transfers if tr.direction == "load" for b in tr.bindings]
        for n in made:
            found.setdefault(f"{p.kind.text}_{n.text}", n.span)
    return found


# ---- positions in a text that changed since an analysis -----------------------------------

def line_map(old: str, new: str) -> dict[int, int]:
    """1-based lines of `old` that `new` keeps unchanged -> their lines in `new`."""
    a, b = old.splitlines(), new.splitlines()
    out = {}
    for i, j, n in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        out.update({i + k + 1: j + k + 1 for k in range(n)})
    return out


def moved(span: Span, lines: dict[int, int]) -> Span | None:
    """`span` of an old text in the new one, if the new text kept its lines."""
    if span.line not in lines or span.end_line not in lines:
        return None
    return Span(span.file, lines[span.line], span.column, lines[span.end_line], span.end_column)


# ---- blocks: where the cursor is, from the text alone ----------------------------------------

_LEXEME = re.compile(r'"[^"\n]*"|#[^\n]*|[{}]|[A-Za-z_][A-Za-z0-9_]*|[0-9]+')


@dataclass(frozen=True)
class Block:
    """A `schedule`, `phase`, `stream` or `pool` block: what it is, its name (a phase's layer
    kind), and where it opens and closes (offsets; `end` None while it is not closed)."""

    what: str
    name: str
    start: int
    end: int | None


def blocks(text: str) -> list[Block]:
    """Every block of `text`, by its braces and the words before each `{` (comments and strings
    skipped): a text with errors still has them."""
    found: list[Block] = []
    open_: list[int] = []                    # indexes into `found`
    words: list[str] = []
    for m in _LEXEME.finditer(text):
        tok = m.group()
        if tok[0] in '#"':
            continue
        if tok == "{":
            what = next((w for back, w in ((2, "schedule"), (2, "phase"), (2, "pool"), (4, "stream"))
                         if len(words) >= back and words[-back] == w), "block")
            name = words[-(4 if what == "stream" else 2) + 1] if what != "block" else ""
            found.append(Block(what, name, m.start(), None))
            open_.append(len(found) - 1)
            words = []
        elif tok == "}":
            if open_:
                i = open_.pop()
                found[i] = replace(found[i], end=m.end())
            words = []
        else:
            words.append(tok)
    return found


def enclosing(text: str, offset: int) -> list[Block]:
    """The blocks around `offset`, outermost first."""
    return [b for b in blocks(text) if b.start < offset and (b.end is None or offset < b.end)]


def _offset(text: str, line: int, character: int) -> int:
    lines = text.split("\n")
    return sum(len(x) + 1 for x in lines[:line]) + min(character, len(lines[line]) if line < len(lines)
                                                       else 0)


def phase_at(text: str, line: int) -> str | None:
    """The layer kind of the phase block around 0-based `line`."""
    return next((b.name for b in reversed(enclosing(text, _offset(text, line, 0))) if b.what == "phase"),
                None)


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


def hover_text(analysis: Analysis, name: str | None, line: int | None) -> str | None:
    """Markdown for a hover on the defined `name` (a phase's buffer as `KIND_name`): the
    buffer, and the VMEM live at the program point of the statement at 1-based `line` of the
    analysed text (None: the line is not in it)."""
    c = analysis.compiled
    if c is None:
        return None
    parts = []
    buffer = next((b for b in c.ir.buffers if b.name == name), None)
    if buffer is not None:
        b = buffer.at_batch(c.ir.rows_max)
        scope = f", scoped in `{b.scope[0]}`" if b.scope else ", kernel lifetime"
        parts.append(f"**{b.label}**: {b.cls} buffer {list(b.shape)} {b.dtype}, "
                     f"{b.vmem_bytes / MIB:.2f} MiB of VMEM at {c.ir.rows_max} rows{scope}")
    point = vmem_at_line(c, line) if line is not None else None
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


@functools.lru_cache(maxsize=1)
def _keyword_terminals() -> dict[str, str]:
    """The grammar's keyword terminals: terminal name -> the word."""
    return {t.name: t.pattern.value for t in parser.lark_parser().terminals
            if t.pattern.type == "str" and t.pattern.value.isalpha()}


def keywords() -> list[str]:
    """The language's keywords, from its grammar."""
    return sorted(set(_keyword_terminals().values()))


def _rule_text(grammar: str, rule: str) -> str:
    """A rule of a statement module's grammar with the `//` comment lines above it."""
    lines = grammar.strip().splitlines()
    at = next(i for i, line in enumerate(lines) if line.split(":")[0].strip() == rule)
    first = at
    while first > 0 and lines[first - 1].startswith("//"):
        first -= 1
    last = at + 1
    while last < len(lines) and lines[last].lstrip().startswith("|"):
        last += 1
    return "\n".join(lines[first:last])


@functools.lru_cache(maxsize=1)
def statement_docs() -> dict[str, str]:
    """Each statement keyword's description: its module's summary (where the module holds
    that statement alone, or a few of one meaning) and its grammar rule with its comments."""
    out: dict[str, list[str]] = {}
    for m in syntax.modules():
        summary = (importlib.import_module(m.module).__doc__ or "").strip().split("\n\n")[0]
        for st in m.statements:
            parts = out.setdefault(st.keyword, [])
            if summary and len(m.statements) <= 2 and summary not in parts:
                parts.append(" ".join(summary.split()))
            parts.append(f"```\n{_rule_text(m.grammar, st.rule)}\n```")
    return {k: f"**{k}**" + (" (a header setting, once a spec)" if any(
        st.setting for st in syntax.statements() if st.keyword == k) else "") + ": " + "\n\n".join(v)
        for k, v in out.items()}


def keyword_hover(text: str, line: int, word: str) -> str | None:
    """The description of the statement a keyword at 0-based `line` belongs to: the line's
    first word when it starts a statement, else the block around it (`then` of a stream)."""
    if word not in _keyword_terminals().values():
        return None
    docs = statement_docs()
    first = (text.splitlines()[line].split() or [""])[0]
    if first in docs:
        return docs[first]
    around = enclosing(text, _offset(text, line, 0))
    return docs.get(around[-1].what) if around else None


# ---- completion by the grammar's context -----------------------------------------------------

@dataclass(frozen=True)
class Offer:
    label: str
    kind: types.CompletionItemKind
    detail: str = ""


def _copies(text: str, phase: Block, skip_line: int) -> tuple[dict[str, set[str]], dict[str, str],
                                                               set[str]]:
    """A phase block's buffers as its lines write them (the cursor's line `skip_line` aside):
    the states loaded into each, the state each is stored to, the names its `scoped` lines
    hold."""
    loads: dict[str, set[str]] = {}
    stores: dict[str, str] = {}
    scoped: set[str] = set()
    body = text[phase.start:phase.end]
    first_line = text.count("\n", 0, phase.start)
    for i, line in enumerate(body.split("\n")):
        if first_line + i == skip_line:
            continue
        code = line.split("#", 1)[0].strip()
        words = code.split()
        if not words:
            continue
        if words[0] in ("load", "store"):
            for src, dst in re.findall(r"([\w.]+)\s*->\s*([\w.]+)", code.split(";")[0]):
                if words[0] == "load" and src.startswith("state."):
                    loads.setdefault(dst, set()).add(src[6:])
                elif words[0] == "store" and dst.startswith("state."):
                    stores[src] = dst[6:]
        elif words[0] == "scoped":
            m = re.match(r"scoped\s+(.*?)\s+from\b", code)
            scoped |= set(re.findall(r"\w+", m.group(1))) if m else set()
    return loads, stores, scoped


def _settings_written(text: str, schedule: Block | None) -> set[str]:
    """The header settings the schedule block has (a second one is refused)."""
    settings = {st.keyword for st in syntax.statements("schedule") if st.setting}
    if schedule is None:
        return set()
    body = text[schedule.start + 1:schedule.end]
    inner = [b for b in blocks(text) if b.start > schedule.start and (schedule.end is None or
                                                                     b.start < schedule.end)]
    for b in sorted(inner, key=lambda b: -b.start):          # statements inside blocks aside
        if b.end is not None:
            body = body[:b.start - schedule.start - 1] + body[b.end - schedule.start - 1:]
    return {w for w in re.findall(r"(?m)^\s*([a-z]+)\b", body) if w in settings}


def _names_for(tokens: list, text: str, line: int, around: list[Block],
               model: ModelNames | None) -> list[Offer]:
    """The names a spec may write where the grammar wants a NAME after `tokens` (the
    cursor's statement so far)."""
    types_ = [t.type for t in tokens]
    prev = types_[-1] if types_ else ""
    inner = around[-1] if around else None
    phase = next((b for b in reversed(around) if b.what == "phase"), None)
    kind = phase.name if phase else None
    op, var, kw = (types.CompletionItemKind.Function, types.CompletionItemKind.Variable,
                   types.CompletionItemKind.Module)
    ops = model.ops.get(kind, []) if model and kind else []
    states = model.states.get(kind, []) if model and kind else []
    if prev == "PHASE":
        written = {b.name for b in blocks(text) if b.what == "phase"}
        return [Offer(k, kw, "layer kind") for k in (model.layer_kinds if model else ())
                if k not in written]
    if prev == "TARGET":
        return [Offer(g, types.CompletionItemKind.Constant, "TPU generation")
                for g in targets.known_chips()]
    if prev == "STREAM":
        rings = re.findall(r"(?m)^\s*ring\s+([A-Za-z_]\w*)\s*:", text)
        return [Offer(r, var, "ring") for r in dict.fromkeys(rings)]
    if inner is not None and inner.what == "stream" and not tokens:
        listed = {m.group(1) for i, x in enumerate(text[inner.start:inner.end].split("\n"))
                  if text.count("\n", 0, inner.start) + i != line
                  and (m := re.match(r"\s*([A-Za-z_]\w*)\s*:", x))}
        return [Offer(k, kw, "layer kind") for k in (model.layer_kinds if model else ())
                if k not in listed]
    if phase is None:
        return []
    if prev in ("BEFORE", "AFTER"):
        return [Offer(o, op, f"op of {kind}") for o in ops]
    if prev == "NEXT":
        return [Offer(kind, kw, "this phase's layer kind")]
    if prev == "AT":
        return [Offer(p, types.CompletionItemKind.Constant, "program point") for p in ("start", "end")]
    if prev == "DOT" and len(tokens) > 1 and tokens[-2] == "state":
        return [Offer(n, types.CompletionItemKind.Field, f"state of {kind}") for n in states]
    statement = next((t.type for t in tokens if t.type in ("LOAD", "STORE", "SCOPED")), None)
    loads, stores, scoped = _copies(text, phase, line)
    loaded = sorted(loads)
    if statement == "SCOPED":
        if prev == "FROM":
            return [Offer(o, op, f"op of {kind}") for o in ["start", *ops]]
        if prev == "TO":
            return [Offer(o, op, f"op of {kind}") for o in [*ops, "end"]]
        if prev in ("SCOPED", "COMMA"):
            held = {t.value for t in tokens if t.type == "NAME"}
            return [Offer(n, var, "buffer a load fills") for n in loaded if n not in held]
        return []
    if statement is None or "SEMICOLON" in types_:
        return []
    as_state = [Offer(f"state.{n}", types.CompletionItemKind.Field, f"state of {kind}") for n in states]
    if statement == "LOAD" and prev in ("LOAD", "COMMA"):
        return as_state
    if statement == "STORE" and prev == "_ARROW":
        return as_state
    if statement == "STORE" and prev in ("STORE", "COMMA"):
        return [Offer(n, var, "buffer a load fills") for n in loaded]
    if statement == "LOAD" and prev == "_ARROW":
        state = tokens[-2].value if len(tokens) > 3 and tokens[-4] == "state" else ""
        # a buffer holds one state: names of its store or `scoped` lines no other load fills
        named = [*sorted(scoped), *sorted(stores)]
        return [Offer(n, var, "buffer of this phase") for n in dict.fromkeys(named)
                if n not in loads and stores.get(n, state) == state]
    return []


def completions(text: str, line: int, character: int, model: ModelNames | None) -> list[Offer]:
    """What may be written at 0-based (line, character): the cursor's statement so far is fed
    to the grammar's parser inside the blocks around it; the keywords it accepts next, and
    where it accepts a name, the names of `_names_for`. None where a comment or a bad token
    stands before the cursor."""
    lines = text.split("\n")
    if not 0 <= line < len(lines):
        return []
    here = lines[line][:character]
    if "#" in here:
        return []
    typed = re.search(r"[A-Za-z_][A-Za-z0-9_]*$", here)
    here = here[:typed.start()] if typed else here
    offset = _offset(text, line, 0)
    around = enclosing(text, offset)
    heads = {"schedule": "schedule _ {{", "phase": "phase {name} {{", "stream": "stream {name} ahead 1 {{",
             "pool": "pool {name} {{"}
    prefix = " ".join(heads[b.what].format(name=b.name or "_") for b in around if b.what in heads)
    if not prefix.startswith("schedule"):
        prefix = ""
    try:
        n_prefix = len(parser.lark_parser().parse_interactive(prefix).exhaust_lexer())
        ip = parser.lark_parser().parse_interactive(prefix + "\n" + here)
        tokens = ip.exhaust_lexer()[n_prefix:]
        accepts = ip.accepts()
    except Exception:                     # a token the grammar refuses before the cursor
        return []
    offers: dict[str, Offer] = {}
    schedule = next((b for b in around if b.what == "schedule"), None)
    written = _settings_written(text, schedule) if not tokens else set()
    for name in sorted(accepts):
        word = _keyword_terminals().get(name)
        if word and word not in written:
            offers.setdefault(word, Offer(word, types.CompletionItemKind.Keyword))
    if "NAME" in accepts:
        for o in _names_for(tokens, text, line, around, model):
            offers.setdefault(o.label, o)
    return list(offers.values())


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

    @lsp_method(types.EXIT)
    def lsp_exit(self, *args) -> None:
        """Ends the session: `start_io` returns 0 after `shutdown`, 1 without (the protocol's
        codes). pygls' own raises SystemExit out of a callback of the message loop, and the
        loop's teardown loses its code."""
        self._server.end(0 if self._shutdown else 1)

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


class _StdinReader(io.RawIOBase):
    """The bytes of file descriptor `fd` until it ends or `stop()` is called.

    The stdin thread reads through this, not through sys.stdin: a thread blocked in a read of
    sys.stdin holds its buffer's lock, and the interpreter aborts when it closes sys.stdin at
    shutdown ("could not acquire lock for <_io.BufferedReader name='<stdin>'>"). A read here
    waits on the descriptor and on a pipe of its own, so `stop` ends a blocked read and the
    thread is joined before the interpreter shuts down."""

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd
        self._wake_r, self._wake_w = os.pipe()
        self._selector = selectors.PollSelector()     # poll, unlike epoll, takes a regular file
        self._selector.register(fd, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:
        while True:
            ready = {key.fd for key, _ in self._selector.select()}
            if self._wake_r in ready:
                return 0                                  # stopped: an end of input
            if self._fd in ready:
                data = os.read(self._fd, len(buffer))
                buffer[:len(data)] = data
                return len(data)

    def stop(self) -> None:
        os.write(self._wake_w, b"\0")

    def close(self) -> None:
        if not self.closed:
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
        super().close()


class _Server(LanguageServer):
    analyses: Analyses | None = None
    _message_loop: asyncio.AbstractEventLoop | None = None
    _ended: Callable[[], None] | None = None
    _exit_code: int | None = None

    def start_io(self, stdin: BinaryIO | None = None, stdout: BinaryIO | None = None) -> int:
        """Serve over stdio until `exit` or the end of the input, with `read_frames` splitting
        the input on its own thread; the process's exit status: 0 once `shutdown` was
        answered, else 1 (an input that ends without `exit` is the client gone)."""
        self.protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
        raw = _StdinReader((stdin or sys.stdin.buffer).fileno())
        frames = io.BufferedReader(raw)          # held here: collected, it would close `raw`
        reader = threading.Thread(target=self._read, args=(frames,), name="mkc-lsp-stdin")
        try:
            asyncio.run(self._serve(reader))
        except BrokenPipeError:
            logger.error("the client closed the connection")
        except KeyboardInterrupt:
            pass
        finally:
            raw.stop()
            if reader.is_alive():
                reader.join()
            frames.close()
            self.shutdown()
        if self._exit_code is None:
            self._exit_code = 0 if self.protocol._shutdown else 1
        return self._exit_code

    def end(self, code: int) -> None:
        """End the session with exit status `code` (on the message loop)."""
        self._exit_code = code
        if self._ended is not None:
            self._ended()

    async def _serve(self, reader: threading.Thread) -> None:
        ended = asyncio.Event()
        self._message_loop, self._ended = asyncio.get_running_loop(), ended.set
        reader.start()
        await ended.wait()

    def _on_loop(self, handle: Callable, *args) -> None:
        try:
            self._message_loop.call_soon_threadsafe(handle, *args)
        except RuntimeError:
            pass                                  # the loop has ended (after `exit`)

    def _read(self, stdin: BinaryIO) -> None:
        try:
            read_frames(stdin, lambda body: self._on_loop(self.protocol.handle_body, body),
                        lambda why: self._on_loop(self.protocol.answer_error, None, JsonRpcParseError(why)))
        finally:
            self._on_loop(self._ended)


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
EXIT_WAIT_S = 0.2                # for the analyses' worker to end after `exit`, before the process ends


class Analyses:
    """The open documents' analyses, run on one worker thread so that no request waits for one.
    A change schedules an analysis of the document's text ANALYSIS_DELAY_S later; one whose
    document changed again before it started is skipped, and one that finishes after a newer
    change is dropped, so only the newest text is analysed and published."""

    def __init__(self, server: LanguageServer):
        self.server = server
        self.checked: dict[str, Analysis] = {}      # uri -> its last analysis that checked
        self.parsed: dict[str, Analysis] = {}       # uri -> its last analysis that parsed
        self.models: dict[str, ModelNames] = {}     # uri -> the model names last resolved
        self._threads: list[threading.Thread] = []   # the worker's, once it has started
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mkc-lsp-analysis",
                                         initializer=lambda: self._threads.append(threading.current_thread()))
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
        for known in (self.checked, self.parsed, self.models):
            known.pop(uri, None)

    def _newest(self, uri: str, change: int) -> bool:
        return self._changes.get(uri) == change

    def close(self, timeout: float) -> bool:
        """Stop the worker, dropping queued work; whether it ended within `timeout` s (an
        analysis under way cannot be interrupted)."""
        self.worker.shutdown(wait=False, cancel_futures=True)
        for thread in self._threads:
            thread.join(timeout)
        return not any(thread.is_alive() for thread in self._threads)

    async def _analyse(self, uri: str, change: int, delay: float) -> None:
        await asyncio.sleep(delay)
        doc = self.server.workspace.text_documents.get(unquote(uri))     # oversized too
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
        if analysis.sched is not None:
            self.parsed[uri] = analysis
        if analysis.model is not None:
            self.models[uri] = analysis.model
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


def definition_at(analyses: Analyses, uri: str, text: str, line: int, character: int
                  ) -> tuple[str, Span] | None:
    """The defined name under 0-based (line, character) of `text` (a phase's buffer as
    `KIND_name`) and where it is defined in `text`: from the newest analysis that parsed (and
    then the newest that checked, for buffers only the IR names), its lines mapped onto `text`
    where they differ."""
    word = word_at(text, line, character)
    if word is None:
        return None
    kind = phase_at(text, line)
    for known in (analyses.parsed.get(uri), analyses.checked.get(uri)):
        if known is None:
            continue
        for name in ([f"{kind}_{word}"] if kind else []) + [word]:
            span = known.definitions.get(name)
            if span is not None and known.text != text:
                span = moved(span, line_map(known.text, text))
            if span is not None:
                return name, span
    return None


def hover_at(analyses: Analyses, uri: str, text: str, line: int, character: int) -> str | None:
    """Markdown for a hover at 0-based (line, character) of `text`: on a keyword, its
    statement; on a defined name, the newest checked analysis's buffer (or where the name is
    defined, when no analysis has checked it); the VMEM live at the line's program point
    where the checked text has the line."""
    word = word_at(text, line, character)
    defined = definition_at(analyses, uri, text, line, character)
    if defined is None and word is not None and (about := keyword_hover(text, line, word)):
        return about
    checked = analyses.checked.get(uri)
    parts = []
    if checked is not None:
        here = line + 1 if checked.text == text else {
            new: old for old, new in line_map(checked.text, text).items()}.get(line + 1)
        name = defined[0] if defined else word
        if found := hover_text(checked, name, here):
            parts.append(found)
    if defined is not None and not any(p.startswith("**") for p in parts):
        name, span = defined
        source = text.splitlines()[span.line - 1].split("#", 1)[0].strip()
        parts.insert(0, f"**{word}**: defined at line {span.line}: `{source}`")
    return "\n\n".join(parts) or None


def open_document(server: LanguageServer, uri: str) -> TextDocument | None:
    """The document the editor opened at `uri`; None for any other (pygls would read it from
    disk), and for one over the parser's size limit (its one diagnostic says so; scanning it
    for a request would take seconds)."""
    doc = server.workspace.text_documents.get(unquote(uri))
    if doc is None or len(doc.source) > parser.MAX_SPEC_BYTES:
        return None
    return doc


def build_server() -> _Server:
    server = _Server("mkc", mkc.__version__, protocol_cls=_Protocol)
    analyses = server.analyses = Analyses(server)

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
        found = hover_at(analyses, uri, doc.source, pos.line, pos.character)
        if not found:
            return None
        return types.Hover(contents=types.MarkupContent(kind=types.MarkupKind.Markdown, value=found))

    @feature(types.TEXT_DOCUMENT_DEFINITION)
    def definition(ls: LanguageServer, params: types.DefinitionParams) -> types.Location | None:
        uri, pos = params.text_document.uri, params.position
        doc = open_document(ls, uri)
        if doc is None:
            return None
        found = definition_at(analyses, uri, doc.source, pos.line, pos.character)
        return types.Location(uri=uri, range=_range(found[1])) if found else None

    @feature(types.TEXT_DOCUMENT_COMPLETION)
    def completion(ls: LanguageServer, params: types.CompletionParams) -> types.CompletionList:
        uri, pos = params.text_document.uri, params.position
        doc = open_document(ls, uri)
        offers = completions(doc.source, pos.line, pos.character, analyses.models.get(uri)) if doc else []
        return types.CompletionList(is_incomplete=False, items=[
            types.CompletionItem(label=o.label, kind=o.kind, detail=o.detail or None) for o in offers])

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
    server = build_server()
    code = server.start_io()
    if not server.analyses.close(EXIT_WAIT_S):
        # An analysis is under way; no one will read it, and the interpreter would wait for its
        # thread before exiting, for seconds on a long text. Everything written is flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code

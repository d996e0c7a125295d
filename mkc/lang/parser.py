"""Parse .sched text into the typed AST (mkc.lang.ast), with spans and friendly syntax errors."""
from __future__ import annotations

import codecs
import difflib

from functools import lru_cache
from pathlib import Path

import lark
from lark import Transformer, v_args

from mkc.diagnostics import MkcError, Span, fail, source_lines
from mkc.lang import ast, syntax

# Token names as a user would call them, for "expected ..." hints.
_TOKEN_WORDS = {
    "NAME": "a name", "INT": "an integer", "STRING": 'a quoted string like "qwen3_8_27b"',
    "TOPOLOGY": "a topology like 2x4 or 2x2x1", "UNIT": "a unit (KiB, MiB, GiB)",
    "LBRACE": "'{'", "RBRACE": "'}'", "COLON": "':'", "SEMICOLON": "';'", "COMMA": "','",
    "EQUAL": "'='", "DOT": "'.'", "_ARROW": "'->'", "SLASH": "'/'", "LPAR": "'('",
    "RPAR": "')'",
}
_MAX_TOPOLOGY_DIMS = 8     # TPU slices are 2-D or 3-D; resolve says which per generation
MAX_SPEC_BYTES = 256 << 10    # a schedule is a few KiB; parsing costs ~10 us a byte
_UNIT_BYTES = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_int(digits: str, span: Span) -> int:
    """A number written in a spec (or given for one on the command line): bounded before
    conversion, since Python refuses integers of over 4300 digits and no size in a schedule
    comes near 12."""
    if len(digits) > ast.MAX_DIGITS:
        raise fail("E-RANGE", f"the number {digits[:20]}... has {len(digits)} digits", span,
                   hint=f"numbers in a schedule are 0 to {10 ** ast.MAX_DIGITS - 1:,} (at most "
                        f"{ast.MAX_DIGITS} digits)")
    return int(digits)


def parse_topology(grid: str, span: Span) -> tuple[int, ...]:
    """A chip grid `2x2x1` as its dimensions, each a bounded number."""
    parts = grid.split("x")
    if len(parts) > _MAX_TOPOLOGY_DIMS:
        raise fail("E-RANGE", f"topology {grid[:40]} has {len(parts)} dimensions", span,
                   hint="write the chip grid as the generation does, e.g. 2x4 (v6e) or "
                        "2x2x1 (tpu7x)")
    return tuple(parse_int(p, span) for p in parts)


@lru_cache(maxsize=1)
def lark_parser() -> lark.Lark:
    # cache: lark keeps the LALR tables in the temp directory, keyed by the grammar's digest
    # (building them is most of a syntax error's answer time: 0.4 s of 0.6).
    return lark.Lark(syntax.grammar(), parser="lalr", propagate_positions=True,
                     maybe_placeholders=False, cache=True)


@lru_cache(maxsize=1)
def _statement_rules() -> dict[str, syntax.Statement]:
    return {s.rule: s for s in syntax.statements()}


class _ToAst(Transformer):
    """The base grammar's rules here; every statement's rules by its module's builders."""

    def __init__(self, file: str):
        super().__init__()
        self.b = syntax.Builder(file)
        self.file = file
        self.builders = syntax.builders()

    def __default__(self, data, children, meta):
        build = self.builders.get(str(data))
        if build is None:
            return super().__default__(data, children, meta)
        node = build(self.b, meta, children)
        statement = _statement_rules().get(str(data))
        return node if statement is None else syntax.Placed(statement, node)

    # --- leaves -------------------------------------------------------------------
    def INT(self, tok: lark.Token) -> int:
        return parse_int(str(tok), self.b.span(tok))

    def TOPOLOGY(self, tok: lark.Token) -> tuple[ast.Name, tuple[int, ...]]:
        """The grid's text (for messages) and its dimensions; how many a generation takes is
        resolve's business."""
        return self.b.name(tok), parse_topology(str(tok), self.b.span(tok))

    def name_list(self, items):
        return [self.b.name(t) for t in items]

    def dotted(self, items):
        first, last = items[0], items[-1]
        span = Span(self.file, first.line, first.column, last.end_line, last.end_column)
        return ast.Name(".".join(str(t) for t in items), span)

    @v_args(meta=True)
    def size(self, meta, items):
        return ast.Setting(int(items[0]) * _UNIT_BYTES[str(items[1])], self.b.span(meta))

    def point_at(self, items):
        return ast.Point("at", self.b.name(items[0]))

    def point_before(self, items):
        return ast.Point("before", self.b.name(items[0]))

    def point_before_next(self, items):
        return ast.Point("before next", self.b.name(items[0]))

    def point_after(self, items):
        return ast.Point("after", self.b.name(items[0]))

    @v_args(meta=True)
    def group_named(self, meta, items):
        return ast.Group(self.b.name(items[0]), divisor=int(items[1]) if len(items) > 1 else None,
                         span=self.b.span(meta))

    @v_args(meta=True)
    def group_ways(self, meta, items):
        return ast.Group(None, ways=int(items[0]), span=self.b.span(meta))

    @v_args(meta=True)
    def schedule(self, meta, items):
        sched = ast.Schedule(self.b.name(items[0]), self.file, syntax.empty_lists("schedule"))
        for item in items[1:]:
            key = item.statement.joins
            if not item.statement.setting:
                sched.lists[key].append(item.node)
            elif key in sched.settings:
                first = sched.settings[key].span
                raise fail("E-DUPLICATE", f"'{key}' is set twice", item.node.span,
                           hint=f"keep one '{key}' line (the first is at line {first.line})")
            else:
                sched.settings[key] = item.node
        return sched

    def start(self, items):
        return items[0]


def _expected_words(expected: set[str]) -> str:
    words = sorted({_TOKEN_WORDS.get(e, f"'{e.lower()}'" if e.isupper() else e) for e in expected})
    if len(words) > 8:
        words = words[:8] + ["..."]
    return ", ".join(words)


def _copy_statement(e: lark.UnexpectedToken) -> tuple[lark.Token, lark.Token, str] | None:
    """When the parser stopped in a `load`/`store` before its `;`: its keyword, its last token
    so far and the phase's layer kind (from the parser's stack)."""
    if getattr(e, "interactive_parser", None) is None:
        return None
    stack = e.interactive_parser.parser_state.value_stack
    keyword = next((i for i in range(len(stack) - 1, -1, -1) if isinstance(stack[i], lark.Token)
                    and stack[i].type in ("LOAD", "STORE", "SEMICOLON", "LBRACE")), None)
    if keyword is None or stack[keyword].type not in ("LOAD", "STORE"):
        return None
    last = (list(stack[-1].scan_values(lambda v: isinstance(v, lark.Token)))
            if isinstance(stack[-1], lark.Tree) else [stack[-1]])
    if not last:
        return None
    phase = next((stack[i + 1] for i in range(keyword - 1, -1, -1)
                  if isinstance(stack[i], lark.Token) and stack[i].type == "PHASE"), "KIND")
    return stack[keyword], last[-1], str(phase)


def _rest_of_line(text: str, tok: lark.Token) -> str:
    """The source from `tok` to the end of its line, without a comment."""
    end = text.find("\n", tok.start_pos)
    return text[tok.start_pos:None if end < 0 else end].split("#", 1)[0].strip()


def _copy_without_wait(e: lark.UnexpectedToken, text: str, file: str) -> MkcError | None:
    """A `load`/`store` that ends (or runs into `wait`) without `; wait POINT`: a diagnostic
    at the statement, not at the next line's first word."""
    if "SEMICOLON" not in e.expected or (found := _copy_statement(e)) is None:
        return None
    keyword, last, kind = found
    written = " ".join(text[keyword.start_pos:last.end_pos].split())
    tok = e.token
    if tok.type == "WAIT":
        return fail("E-SYNTAX", "unexpected 'wait': a ';' must separate the start point from "
                    "the waits", Span(file, tok.line, tok.column, tok.end_line, tok.end_column),
                    hint=f"write `{written}; {_rest_of_line(text, tok)}`")
    if tok.line == last.end_line and tok.type != "RBRACE":
        return None            # something else follows on the statement's line
    direction = keyword.type.lower()
    example = ("; wait before OP` (OP the first op reading the state)" if direction == "load"
               else f"; wait before next {kind}` (it drains behind the rest of the layer) or "
                    "`; wait after OP`")
    return fail("E-SYNTAX", f"the {direction} is never waited: a {direction} needs `; wait "
                "POINT` after its start point",
                Span(file, keyword.line, keyword.column, last.end_line, last.end_column),
                hint=f"write `{written}{example}")


def _unclosed_block(e: lark.UnexpectedToken, text: str, file: str) -> MkcError | None:
    """A block inside the schedule (a phase's, the stream's, a pool's) whose '}' is missing,
    found where a statement that cannot stand inside it begins and would parse with a '}'
    before it: the diagnostic where the '}' belongs, after the block's last statement."""
    parser = getattr(e, "interactive_parser", None)
    if parser is None or "RBRACE" not in e.expected:
        return None
    opens = [t for t in parser.parser_state.value_stack if isinstance(t, lark.Token) and t.type == "LBRACE"]
    if len(opens) < 2:          # only the schedule's own block is open
        return None
    trial = parser.copy()
    try:
        trial.feed_token(lark.Token("RBRACE", "}"))
        trial.feed_token(e.token)
    except lark.exceptions.UnexpectedInput:
        return None
    lines = source_lines(text)
    opened = opens[-1]
    block = lines[opened.line - 1][:opened.column - 1].split("#", 1)[0].strip()
    tok, line = e.token, e.token.line
    code = lines[line - 1][:tok.column - 1].split("#", 1)[0].rstrip()
    while not code and line > opened.line:      # back over blank and comment lines
        line -= 1
        code = lines[line - 1].split("#", 1)[0].rstrip()
    return fail("E-SYNTAX", f"`{block} {{` has no closing '}}': {str(tok)!r} at line {tok.line} cannot stand "
                "inside it", Span(file, line, len(code) + 1, line, len(code) + 2),
                hint=f"is a '}}' missing? close `{block} {{` (line {opened.line}) here")


def _ended(text: str, file: str, expected: set[str]) -> MkcError:
    """The diagnostic of a spec that ends before its schedule does (at its end), or of one with
    nothing but comments and blank lines (at its start)."""
    lines = source_lines(text) or [""]
    if all(not ln.strip() or ln.lstrip().startswith("#") for ln in lines):
        return fail("E-SYNTAX", "the spec is empty: it has no schedule", Span(file, 1, 1, 1, 2),
                    hint="a spec is one `schedule NAME { ... }` block: start from one in schedules/ "
                         "(docs/language.md; `mkc grammar` prints the whole grammar)")
    span = Span(file, len(lines), len(lines[-1]) + 1, len(lines), len(lines[-1]) + 1)
    return fail("E-SYNTAX", "the file ends in the middle of a statement", span,
                hint=f"expected {_expected_words(expected)}; is a '}}' missing?")


def parse(text: str, file: str = "<spec>") -> ast.Schedule:
    """Parse a whole .sched source; raise MkcError (never a lark exception) on bad input."""
    refuse_oversized(len(text.encode("utf-8", "replace")), file)
    try:
        tree = lark_parser().parse(text)
    except lark.UnexpectedCharacters as e:
        span = Span(file, e.line, e.column, e.line, e.column + 1)
        char = text[e.pos_in_stream] if e.pos_in_stream is not None else "?"
        raise fail("E-SYNTAX", f"unexpected character {char!r}", span,
                   hint=f"expected {_expected_words(set(e.allowed or ()))}") from None
    except lark.UnexpectedEOF as e:
        raise _ended(text, file, set(e.expected)) from None
    except lark.UnexpectedToken as e:
        tok = e.token
        if tok.type == "$END":
            raise _ended(text, file, set(e.expected)) from None
        span = Span(file, tok.line, tok.column, tok.end_line or tok.line,
                    tok.end_column or tok.column + len(str(tok)))
        if (no_wait := _copy_without_wait(e, text, file)) is not None:
            raise no_wait from None
        if (unclosed := _unclosed_block(e, text, file)) is not None:
            raise unclosed from None
        hint = f"expected {_expected_words(set(e.expected))}"
        if set(e.expected) == {"WAIT"}:
            hint = (f"write `wait {_rest_of_line(text, tok)}`: each wait point of a load or "
                    "store starts with `wait`")
        if tok.type == "NAME" or any(str(tok) == st.keyword for st in syntax.statements()
                                       if st.setting):
            hint += f"; '{tok}' cannot start or continue a statement here"
            # a misspelt keyword: the closest of the keywords that may stand here
            keywords = sorted({x.lower() for x in e.expected if x.isupper() and x.isalpha()})
            close = difflib.get_close_matches(str(tok), keywords, n=1, cutoff=0.75)
            if close:
                hint = f"did you mean '{close[0]}'? " + hint
        raise fail("E-SYNTAX", f"unexpected {str(tok)!r}", span, hint=hint) from None
    try:
        return _ToAst(file).transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, MkcError):
            raise e.orig_exc from None
        raise


def parse_file(path: str | Path) -> tuple[ast.Schedule, str]:
    """Read and parse a spec; returns the AST and the source text (for rendering diagnostics)."""
    p = Path(path)
    try:
        if not p.is_file():
            what = "a directory" if p.is_dir() else "not a regular file" if p.exists() else None
            if what:
                raise fail("E-IO", f"cannot read spec: it is {what}", Span.unknown(str(p)),
                           hint="pass the path of a .sched file")
        with p.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise fail("E-IO", f"cannot read spec: {e.strerror}", Span.unknown(str(p)),
                   hint="check the path") from None
    refuse_oversized(len(data), str(p))
    return parse_bytes(data, str(p))


def refuse_oversized(size: int, file: str) -> None:
    """A spec of `size` bytes over MAX_SPEC_BYTES is refused before it is parsed, whoever hands
    it over (a file, stdin, an editor's buffer): its parse would take seconds and gigabytes."""
    if size > MAX_SPEC_BYTES:
        raise fail("E-IO", f"the spec is larger than {MAX_SPEC_BYTES >> 10} KiB",
                   Span.unknown(file), hint="a schedule is a few hundred lines of text")


def parse_bytes(data: bytes, file: str = "<spec>") -> tuple[ast.Schedule, str]:
    """Decode UTF-8 (pointing at the first bad byte; a leading byte-order mark, which some
    editors write, is not part of the text) and parse; returns the AST and text."""
    data = data.removeprefix(codecs.BOM_UTF8)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[:e.start]
        line = before.count(b"\n") + 1
        column = e.start - (before.rfind(b"\n") + 1) + 1
        raise fail("E-ENCODING", f"byte 0x{data[e.start]:02x} is not UTF-8 text",
                   Span(file, line, column, line, column + 1),
                   hint="save the spec as UTF-8; a schedule needs only ASCII") from None
    return parse(text, file), text

"""`mkc lsp`: a real LSP client session over stdio against `python -m mkc lsp` (pygls'
client): diagnostics as the text changes, hover, go to definition, completion, formatting; and
raw frames (tests/fuzz/lsp.py's driver): malformed frames and params, a burst of edits, a
huge document."""
import asyncio
import io
import os
import resource
import subprocess
import sys

from lsprotocol import types
from pygls.lsp.client import LanguageClient

from mkc.lsp import read_frames, word_at
from tests_support import ROOT

from fuzz.lsp import LspProcess, frame, notification, opening, position, request, run_session

SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"


def _line_of(text: str, needle: str) -> int:
    """0-based line of the first line containing `needle`."""
    return next(i for i, line in enumerate(text.splitlines()) if needle in line)



async def _start(client, tmp_path) -> None:
    """`mkc lsp` started under `client` over stdio and initialized for `tmp_path`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    await client.start_io(sys.executable, "-m", "mkc", "lsp", env=env)
    await client.initialize_async(types.InitializeParams(capabilities=types.ClientCapabilities(),
                                                         root_uri=tmp_path.as_uri()))
    client.initialized(types.InitializedParams())

async def _session(tmp_path):
    client = LanguageClient("mkc-test", "1")
    published: list[types.PublishDiagnosticsParams] = []
    arrived = asyncio.Event()

    @client.feature(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    def on_diagnostics(params: types.PublishDiagnosticsParams) -> None:
        published.append(params)
        arrived.set()

    async def diagnostics_after(send) -> list[types.Diagnostic]:
        arrived.clear()
        send()
        await asyncio.wait_for(arrived.wait(), 120)
        return published[-1].diagnostics

    await _start(client, tmp_path)
    spec = tmp_path / "q.sched"
    text = SPEC.read_text()
    uri = spec.as_uri()
    doc = types.TextDocumentIdentifier(uri=uri)
    results = {}

    # A spec that checks: no diagnostics.
    results["open"] = await diagnostics_after(lambda: client.text_document_did_open(
        types.DidOpenTextDocumentParams(text_document=types.TextDocumentItem(
            uri=uri, language_id="sched", version=1, text=text))))
    # Typing a VMEM overflow: one located diagnostic with its code and hint, then fixed again.
    bad = text.replace("19 slots of bf16", "60 slots of bf16")

    def change(new: str, version: int):
        return lambda: client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=version),
            content_changes=[types.TextDocumentContentChangeWholeDocument(text=new)]))
    results["overflow"] = await diagnostics_after(change(bad, 2))
    results["typo"] = await diagnostics_after(change(text.replace("allreduce o_proj", "alreduce o_proj"), 3))
    results["fixed"] = await diagnostics_after(change(text, 4))

    line = _line_of(text, "load  state.conv")
    col = text.splitlines()[line].index("conv_buf") + 2
    results["hover"] = await client.text_document_hover_async(
        types.HoverParams(text_document=doc, position=types.Position(line=line, character=col)))
    results["definition"] = await client.text_document_definition_async(
        types.DefinitionParams(text_document=doc, position=types.Position(line=line, character=col)))
    results["completion"] = await client.text_document_completion_async(
        types.CompletionParams(text_document=doc, position=types.Position(line=line, character=4)))
    await diagnostics_after(change(text.replace("  mesh    tp = 8", "mesh tp=8"), 5))
    results["formatting"] = await client.text_document_formatting_async(
        types.DocumentFormattingParams(text_document=doc,
                                       options=types.FormattingOptions(tab_size=2, insert_spaces=True)))
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()
    return text, results


def test_an_editor_session_over_stdio(tmp_path):
    text, r = asyncio.run(_session(tmp_path))
    assert list(r["open"]) == [] and list(r["fixed"]) == []
    [overflow] = r["overflow"]
    assert overflow.code == "E-VMEM-CAPACITY" and "hint:" in overflow.message
    assert overflow.range.start.line == _line_of(text, "ring weights")
    [typo] = r["typo"]
    assert typo.code == "E-SYNTAX" and "did you mean 'allreduce'" in typo.message
    assert typo.range.start.line == _line_of(text, "allreduce o_proj")
    hover = r["hover"].contents.value
    assert "**conv_buf**: state buffer" in hover and "scoped in `gdn`" in hover
    assert "VMEM live here" in hover and "budget" in hover
    # the phase's conv_buf is made by its `scoped` line
    assert r["definition"].range.start.line == _line_of(text, "scoped conv_buf")
    # at a statement's start in a phase: the statements a phase holds, no buffer names
    assert {i.label for i in r["completion"].items} == PHASE_STATEMENTS
    [edit] = r["formatting"]
    assert edit.new_text == text


PHASE_STATEMENTS = {"allgather", "allreduce", "exchange", "fetch", "kv", "load", "prefetch",
                    "refill", "run", "scoped", "store"}
GDN_OPS = {"input_norm", "in_proj", "conv", "delta_rule", "gated_norm", "out_proj", "attn_residual",
           "post_norm", "gate_up", "down", "mlp_residual"}
LOAD_LINE = "    load  state.conv -> conv_buf, state.recurrent -> rec_buf at start; wait before conv\n"
STORE_LINE = "    store rec_buf -> state.recurrent after delta_rule; wait before next gdn\n"
GQA_STREAM = "    gqa: qkv_gate, o_proj, gate_up, down\n"


def _position(text: str, offset: int) -> types.Position:
    before = text[:offset].split("\n")
    return types.Position(line=len(before) - 1, character=len(before[-1]))


# (what the document has in place of one part of the spec, the line the cursor ends, the
# names offered there)
COMPLETIONS = [
    ("after `before`", STORE_LINE, STORE_LINE + "    load state.conv -> conv_buf at start; wait before ",
     GDN_OPS | {"next"}),
    ("after `after`", STORE_LINE, STORE_LINE + "    store conv_buf -> state.conv after ", GDN_OPS),
    ("after `before next`", STORE_LINE, STORE_LINE + "    store rec_buf -> state.recurrent after "
     "delta_rule; wait before next ", {"gdn"}),
    ("after `at`", STORE_LINE, STORE_LINE + "    load state.conv -> conv_buf at ", {"start", "end"}),
    ("after `state.`", STORE_LINE, STORE_LINE + "    load state.", {"conv", "recurrent"}),
    ("a load's HBM side", STORE_LINE, STORE_LINE + "    load ", {"state.conv", "state.recurrent"}),
    ("a store's HBM side", STORE_LINE, STORE_LINE + "    store rec_buf -> ",
     {"state.conv", "state.recurrent"}),
    ("a store's buffer: one a load fills", STORE_LINE, STORE_LINE + "    store ", {"conv_buf", "rec_buf"}),
    # the load being written: a buffer the spec names that holds that state and no load fills
    ("a load's buffer", LOAD_LINE, "    load  state.conv -> ", {"conv_buf"}),
    ("a load's buffer", LOAD_LINE, "    load  state.recurrent -> ", {"rec_buf"}),
    ("a scoped range's end", STORE_LINE, STORE_LINE + "    scoped rec_buf from start to ",
     GDN_OPS | {"end"}),
    ("after the start point", STORE_LINE, STORE_LINE + "    load state.conv -> conv_buf at start; ",
     {"wait"}),
    ("a line's start in a phase", STORE_LINE, STORE_LINE + "    ", PHASE_STATEMENTS),
    ("a line's start in the schedule: no setting twice", "  shard vocab over tp\n",
     "  shard vocab over tp\n  ", {"expect", "format", "parity", "phase", "pool", "ring", "shard",
                                   "stream"}),
    ("a layer kind in a stream", GQA_STREAM, "    ", {"gqa", "then"}),
    ("a layer kind for a phase", "  phase gqa {", "  phase ", {"gqa"}),
    ("a generation", "  target  tpu7x topology 2x2x1", "  target ", {"tpu7x", "v4", "v5e", "v5p", "v6e"}),
    ("in a comment", STORE_LINE, STORE_LINE + "    # load state.", set()),
]


async def _error_session(tmp_path, edits: list[tuple[str, list]]):
    """Open the spec (it checks), then for each (text, requests): change the document to the
    text, wait for its diagnostics, send the requests; their answers in order."""
    client = LanguageClient("mkc-test", "1")
    arrived = asyncio.Event()

    @client.feature(types.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)
    def on_diagnostics(params: types.PublishDiagnosticsParams) -> None:
        arrived.set()

    await _start(client, tmp_path)
    uri = (tmp_path / "q.sched").as_uri()
    doc = types.TextDocumentIdentifier(uri=uri)
    client.text_document_did_open(types.DidOpenTextDocumentParams(text_document=types.TextDocumentItem(
        uri=uri, language_id="sched", version=1, text=SPEC.read_text())))
    await asyncio.wait_for(arrived.wait(), 120)
    answers = []
    for version, (text, requests) in enumerate(edits, start=2):
        arrived.clear()
        client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=version),
            content_changes=[types.TextDocumentContentChangeWholeDocument(text=text)]))
        await asyncio.wait_for(arrived.wait(), 120)
        for method, where in requests:
            if method == "hover":
                answers.append(await client.text_document_hover_async(
                    types.HoverParams(text_document=doc, position=where)))
            elif method == "definition":
                answers.append(await client.text_document_definition_async(
                    types.DefinitionParams(text_document=doc, position=where)))
            else:
                answers.append(await client.text_document_completion_async(
                    types.CompletionParams(text_document=doc, position=where)))
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()
    return answers


def _at(text: str, needle: str, word: str) -> types.Position:
    """The position inside `word` on the first line holding `needle`."""
    line = _line_of(text, needle)
    return types.Position(line=line, character=text.splitlines()[line].index(word) + 1)


def test_hover_and_definition_answer_while_the_document_has_an_error(tmp_path):
    """With an unknown op far below (a resolve error) and then a syntax error with two lines
    inserted above: hover and definition answer from the last parse and check, lines mapped."""
    text = SPEC.read_text()
    unresolved = text.replace("wait after out_proj", "wait after outproj")
    unparsed = text.replace("  model ", "  # one\n  # two\n  model ").replace(
        "allreduce o_proj", "alreduce o_proj")
    load = "load  state.conv"
    a = asyncio.run(_error_session(tmp_path, [
        (unresolved, [("hover", _at(unresolved, load, "conv_buf")),
                      ("definition", _at(unresolved, "store rec_buf", "rec_buf")),
                      ("definition", _at(unresolved, "stream weights", "weights")),
                      ("hover", _at(unresolved, "scoped conv_buf", "scoped")),
                      ("hover", _at(unresolved, "kv tiles", "tiles"))]),
        (unparsed, [("hover", _at(unparsed, load, "conv_buf")),
                    ("definition", _at(unparsed, load, "conv_buf")),
                    ("definition", _at(unparsed, "stream weights", "weights"))]),
    ]))
    assert "**conv_buf**: state buffer" in a[0].contents.value
    assert "VMEM live here" in a[0].contents.value               # the load's line is unchanged
    assert a[1].range.start.line == _line_of(unresolved, load)    # made by the load
    assert a[2].range.start.line == _line_of(unresolved, "ring weights")
    scoped, kv = a[3].contents.value, a[4].contents.value
    assert scoped.startswith("**scoped**: `scoped BUFFERS from OP to OP`") and "scoped_item:" in scoped
    assert kv.startswith("**kv**: ") and "kv_item:" in kv
    assert "**conv_buf**: state buffer" in a[5].contents.value
    assert a[6].range.start.line == _line_of(unparsed, "scoped conv_buf")   # two lines down
    assert a[7].range.start.line == _line_of(unparsed, "ring weights")


def test_completion_offers_what_may_stand_at_the_cursor(tmp_path):
    """Each context's offer, exactly, in a document whose text does not parse (the line being
    written) with the model's names from the text opened before."""
    text = SPEC.read_text()
    edits = []
    for _, part, written, _ in COMPLETIONS:
        assert part in text
        doc = text.replace(part, written + ("\n" if part.endswith("\n") else ""), 1)
        edits.append((doc, [("completion", _position(doc, text.index(part) + len(written)))]))
    answers = asyncio.run(_error_session(tmp_path, edits))
    for (what, _, _, offered), answer in zip(COMPLETIONS, answers):
        labels = [i.label for i in answer.items]
        assert len(labels) == len(set(labels)), what
        assert set(labels) == offered, what


def test_word_at_finds_the_name_under_the_cursor():
    assert word_at("  store rec_buf -> x", 0, 10) == "rec_buf"
    assert word_at("  store rec_buf -> x", 0, 15) == "rec_buf"   # just past its end
    assert word_at("  store rec_buf -> x", 0, 0) is None
    assert word_at("", 3, 0) is None


# Bounds far above what the server takes (tens of milliseconds an answer): before, these
# requests were never answered, or only after the minute the edits' analyses took.
ANSWER_S = 5.0
STARTUP_S = 60.0


def test_a_frame_without_a_valid_length_is_reported_and_the_next_frame_read():
    first, second = frame(request(1, "a", None)), frame(request(2, "b", None))
    stream = (b"Content-Length: abc\r\n" + second[second.index(b"\r\n") + 2:]      # body unread
              + b'Content-Length: x\r\n\r\n{"text": "Content-Length: 5"}'
              + first + b"Content-Type: x\r\n\r\n{}" + second
              + frame(b"x" * 10, b"Content-Length: 999999999999\r\n") + frame(b"{}"))
    bodies, bad = [], []
    read_frames(io.BytesIO(stream), bodies.append, bad.append)
    assert [b[:30] for b in bodies] == [first.partition(b"\r\n\r\n")[2][:30],
                                        second.partition(b"\r\n\r\n")[2][:30], b"{}"]
    assert len(bad) == 4 and "'abc' is not a number" in bad[0] and "without a Content-Length" in bad[2]
    assert "over the 64 MiB" in bad[3]


def _hostile_session(uri: str, frames: list[bytes]) -> dict[int, dict]:
    """Initialize, open the spec at `uri`, send `frames`, shut down: the answers by frame index
    (`frames[0]` is 3), once every request got one and no traceback showed."""
    report = run_session([
        frame(request(0, "initialize", {"processId": None, "rootUri": None, "capabilities": {}})),
        frame(notification("initialized", {})), frame(opening(uri, SPEC.read_text())), *frames,
        frame(request("last", "shutdown", None))], ANSWER_S)
    assert report["unanswered"] == [] and report["tracebacks"] == [] and not report["died"], report
    assert report["exit_code"] == 0 and "Traceback" not in report["stderr"]
    assert report["answers"][len(frames) + 3]["result"] is None            # shutdown
    return report["answers"]


def _labels(answer: dict) -> list[str]:
    return [i["label"] for i in answer["result"]["items"]]


def _errors(answers: dict[int, dict]) -> dict[int, tuple]:
    return {i: (a["id"], a["error"]["code"]) for i, a in answers.items() if "error" in a}


def test_malformed_frames_are_answered_with_parse_errors_and_skipped(tmp_path):
    uri, hover = (tmp_path / "q.sched").as_uri(), "textDocument/hover"
    answers = _hostile_session(uri, [
        frame(request(1, hover, position(uri, 0, 0)), b"Content-Length: abc\r\n"),
        frame(request(2, hover, position(uri, 0, 0))),
        frame(request(3, hover, position(uri, 0, 0)), b"Content-Type: application/json\r\n"),
        frame(request(4, "textDocument/completion", position(uri, 0, 0))),
        frame(b'{"jsonrpc": "2.0", "id": 5, "method": '),
        frame(b"[" * 100000),
        frame(b"[]"),
        frame(request({"a": 1}, hover, position(uri, 0, 0))),
        frame(b'{"id": 6, "method": "textDocument/hover"}'),
        frame(request(7, "textDocument/completion", position(uri, 0, 0))),
    ])
    assert _errors(answers) == {3: (None, -32700), 5: (None, -32700), 7: (None, -32700), 8: (None, -32700),
                                9: (None, -32600), 10: (None, -32600), 11: (6, -32600)}
    assert answers[4]["id"] == 2 and _labels(answers[6]) == ["schedule"]
    assert _labels(answers[12]) == ["schedule"]


def test_bad_requests_get_errors_and_unopened_documents_are_not_read(tmp_path):
    uri, hover = (tmp_path / "q.sched").as_uri(), "textDocument/hover"
    messy = tmp_path / "messy.sched"          # on disk, never opened: not to be read
    messy.write_text(SPEC.read_text().replace("  mesh    tp = 8", "mesh tp=8"))
    answers = _hostile_session(uri, [
        frame(request(6, hover, None)),
        frame(request(7, hover, position(uri, -1, 0))),
        frame(request(8, "textDocument/definition", {"textDocument": {"uri": uri}})),
        frame(request(9, "mkc/nope", {})),
        frame(request(10, hover, position("file:///nonexistent/x.sched", 0, 0))),
        frame(request(11, "textDocument/formatting", {"textDocument": {"uri": messy.as_uri()},
                                                      "options": {"tabSize": 2, "insertSpaces": True}})),
        frame(notification("textDocument/didChange", None)),
        frame(request(12, "textDocument/completion", position(uri, 0, 0))),
    ])
    assert _errors(answers) == {3: (6, -32602), 4: (7, -32602), 5: (8, -32602), 6: (9, -32601)}
    assert "position" in answers[4]["error"]["message"] and "position" in answers[5]["error"]["message"]
    assert answers[7]["result"] is None and answers[8]["result"] is None      # unopened: not read
    assert _labels(answers[10]) == ["schedule"]          # at the file's start


def test_a_request_before_initialize_is_refused_and_the_session_goes_on(tmp_path):
    uri = (tmp_path / "q.sched").as_uri()
    report = run_session([frame(request(1, "textDocument/hover", position(uri, 0, 0))),
                          frame(request(0, "initialize", {"processId": None, "capabilities": {}})),
                          frame(request(2, "shutdown", None))], ANSWER_S)
    assert report["unanswered"] == [] and not report["tracebacks"], report
    early, init, shutdown = (report["answers"][i] for i in range(3))
    assert early["error"]["code"] == -32002 and "initialize" in early["error"]["message"]
    assert "capabilities" in init["result"] and shutdown["result"] is None


def _initialized(server: LspProcess) -> None:
    server.send(frame(request(0, "initialize", {"processId": None, "rootUri": None, "capabilities": {}}))
                + frame(notification("initialized", {})))
    assert server.answer(0, STARTUP_S) is not None


def _diagnostics(server: LspProcess, uri: str, version: int, timeout: float) -> dict | None:
    return server.wait_for(lambda m: m.get("method") == "textDocument/publishDiagnostics"
                           and m["params"]["uri"] == uri and m["params"].get("version") == version, timeout)


def _published(server: LspProcess, uri: str) -> list[dict]:
    return [m["params"] for m in server.received
            if m.get("method") == "textDocument/publishDiagnostics" and m["params"]["uri"] == uri]


def test_a_burst_of_edits_is_analysed_at_its_newest_text_while_requests_answer(tmp_path):
    server = LspProcess()
    try:
        _initialized(server)
        uri, text = (tmp_path / "q.sched").as_uri(), SPEC.read_text()
        server.send(frame(opening(uri, text)))
        assert _diagnostics(server, uri, 1, STARTUP_S)["params"]["diagnostics"] == []
        typo = text.replace("allreduce o_proj", "alreduce o_proj")
        edits = [frame(notification("textDocument/didChange", {
            "textDocument": {"uri": uri, "version": version},
            "contentChanges": [{"text": typo if version % 2 else text}]})) for version in range(2, 202)]
        line = _line_of(text, "load  state.conv")
        col = text.splitlines()[line].index("conv_buf") + 2
        server.send(b"".join(edits) + frame(request(1, "textDocument/hover", position(uri, line, col))))
        hover = server.answer(1, ANSWER_S)      # from the analysis of version 1, not waiting for one
        assert hover is not None and "**conv_buf**" in hover["result"]["contents"]["value"]
        last = _diagnostics(server, uri, 201, STARTUP_S)
        assert [d["code"] for d in last["params"]["diagnostics"]] == ["E-SYNTAX"]
        versions = [p["version"] for p in _published(server, uri)]
        assert versions[0] == 1 and versions[-1] == 201 and len(versions) < 10, versions
    finally:
        server.close()


def test_a_huge_document_gets_a_size_diagnostic_not_an_analysis(tmp_path):
    server = LspProcess()
    try:
        _initialized(server)
        uri = (tmp_path / "huge.sched").as_uri()
        text = SPEC.read_text() + "  # padding padding padding padding\n" * ((5 << 20) // 36)
        server.send(frame(opening(uri, text)) + frame(request(1, "textDocument/hover", position(uri, 3, 3))))
        assert server.answer(1, ANSWER_S)["result"] is None
        published = _diagnostics(server, uri, 1, ANSWER_S)
        assert published is not None
        [d] = published["params"]["diagnostics"]
        assert d["code"] == "E-IO" and "larger than 256 KiB" in d["message"]
        assert d["range"]["start"]["line"] == 0
    finally:
        server.close()


# The protocol's "within a second" of `exit`, in the server's CPU time (the machine may be
# loaded); and a wall-clock bound far above it for a server that waits without computing.
EXIT_CPU_S = 1.0
EXIT_WALL_S = 30.0


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _exit(server: LspProcess, shut_down: bool) -> tuple[int | None, float]:
    """Send `shutdown` (if `shut_down`) and `exit` with the server's input left open, as an
    editor may: (its exit status, or None when it did not exit; the CPU seconds it took to)."""
    if shut_down:
        server.send(frame(request("bye", "shutdown", None)))
        assert server.answer("bye", ANSWER_S)["result"] is None
    spent = server.cpu_seconds() + _children_cpu()
    server.send(frame(notification("exit", None)))
    try:
        code = server.proc.wait(EXIT_WALL_S)
    except subprocess.TimeoutExpired:
        return None, EXIT_WALL_S
    return code, _children_cpu() - spent


def test_exit_ends_the_server_at_once_with_the_protocols_status(tmp_path):
    """0 after `shutdown`, 1 without; no abort at interpreter shutdown (the stdin thread was
    blocked in sys.stdin, holding its lock), and no wait for an analysis no one will read (the
    second session's, the first of a DeepSeek-V3 spec, which imports its modules)."""
    uri = (tmp_path / "q.sched").as_uri()
    deepseek = (ROOT / "schedules" / "deepseek_v3.sched").read_text()
    for text, shut_down in [(SPEC.read_text(), True), (deepseek, False)]:
        server = LspProcess()
        try:
            _initialized(server)
            server.send(frame(opening(uri, text)))
            assert not shut_down or _diagnostics(server, uri, 1, STARTUP_S) is not None
            code, cpu = _exit(server, shut_down)
        finally:
            _, stderr = server.close()
        assert (code, stderr) == (0 if shut_down else 1, "")
        assert cpu < EXIT_CPU_S, (shut_down, cpu)


def test_an_input_that_ends_ends_the_session():
    """Frames, then the end of the input (the client gone, without `exit`): every request
    answered, and the status `exit` would have given (0 after `shutdown`)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-m", "mkc", "lsp"], cwd=ROOT, env=env, capture_output=True,
                       timeout=STARTUP_S, input=frame(request(0, "initialize", {"capabilities": {}}))
                       + frame(request(1, "shutdown", None)))
    assert (r.returncode, r.stderr) == (0, b"")
    assert b'"id": 0' in r.stdout and b'"id": 1, "jsonrpc": "2.0", "result": null' in r.stdout

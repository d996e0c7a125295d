"""`mkc lsp`: a real LSP client session over stdio against `python -m mkc lsp` (pygls'
client): diagnostics as the text changes, hover, go to definition, completion, formatting."""
import asyncio
import os
import sys

from lsprotocol import types
from pygls.lsp.client import LanguageClient

from mkc.lsp import word_at
from tests_support import ROOT

SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"


def _line_of(text: str, needle: str) -> int:
    """0-based line of the first line containing `needle`."""
    return next(i for i, line in enumerate(text.splitlines()) if needle in line)


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

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    await client.start_io(sys.executable, "-m", "mkc", "lsp", env=env)
    await client.initialize_async(types.InitializeParams(capabilities=types.ClientCapabilities(),
                                                         root_uri=tmp_path.as_uri()))
    client.initialized(types.InitializedParams())
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
    bad = text.replace("14 slots of bf16", "60 slots of bf16")

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
    assert "**gdn_conv_buf**: state buffer" in hover and "scoped in `gdn`" in hover
    assert "VMEM live here" in hover and "budget" in hover
    # the phase's conv_buf is made by its `scoped` line
    assert r["definition"].range.start.line == _line_of(text, "scoped conv_buf")
    labels = {i.label for i in r["completion"].items}
    assert {"allreduce", "scoped", "prefetch", "gdn_rec_buf", "weights"} <= labels
    [edit] = r["formatting"]
    assert edit.new_text == text


def test_word_at_finds_the_name_under_the_cursor():
    assert word_at("  store rec_buf -> x", 0, 10) == "rec_buf"
    assert word_at("  store rec_buf -> x", 0, 15) == "rec_buf"   # just past its end
    assert word_at("  store rec_buf -> x", 0, 0) is None
    assert word_at("", 3, 0) is None

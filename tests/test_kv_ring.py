"""`kv ring N slots` (mkc/lang/statements/kv_ring.py, mkc/resolve/kv_ring.py,
mkc/checks/kv_ring.py): a sliding-window layer kind's KV cache kept as a ring of token slots in
HBM. Resolve puts the ring on the kind's KV stream and sizes the cache by it; it refuses a ring
on a kind without a window, a ring that is not whole KV tiles, two rings; the checks refuse a
ring too small for the window (plus a verify step's rows); the trace streams the ring's tiles."""
from pathlib import Path

import pytest

from mkc.checks.kv_ring import ring_needs
from mkc.compiler import check_spec
from mkc.diagnostics import MkcError
from mkc.lang.parser import parse
from tests_support import ROOT

SPEC = ROOT / "schedules" / "gpt_oss_20b.sched"
RING = "    kv ring 256 slots\n"
SWA_TILES = ("kv tiles 2 slots of 128 tokens ahead 2\n    allreduce o_proj direct wire bf16\n  }\n\n"
             "  phase gqa")


def _swa_tiles(tokens: int) -> tuple[str, str]:
    return SWA_TILES, SWA_TILES.replace("of 128 tokens", f"of {tokens} tokens")


def _variant(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    text = SPEC.read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "variant.sched"
    path.write_text(text)
    return path


def _error(path: Path, model: str | None = None):
    with pytest.raises(MkcError) as e:
        check_spec(path, model)
    (d,) = e.value.diagnostics
    assert d.span.file == str(path) and d.hint
    return d


def _line(path: Path, text: str) -> int:
    source = path.read_text()
    return source[:source.index(text)].count("\n") + 1


def test_the_statement_parses_into_its_phase():
    sched = parse(SPEC.read_text(), str(SPEC))
    swa = next(p for p in sched.phases if p.kind.text == "swa")
    gqa = next(p for p in sched.phases if p.kind.text == "gqa")
    (ring,) = swa.kv_rings
    assert ring.slots == 256 and ring.span.line == _line(SPEC, "kv ring 256")
    assert gqa.kv_rings == []


def test_the_ring_is_on_the_sliding_kinds_stream_and_sizes_its_hbm_cache():
    s = check_spec(SPEC).ir
    swa, gqa = s.kinds["swa"].kv, s.kinds["gqa"].kv
    assert (swa.ring, swa.window, swa.tokens) == (256, 128, 128)
    assert (gqa.ring, gqa.window) == (0, 0)
    assert s.context == 4096
    assert swa.cache_tokens(s.context) == 256 and gqa.cache_tokens(s.context) == 4096
    # HBM: the 12 sliding layers hold 256 slots, the 12 full ones the context (per rank:
    # 4 KV heads of 64, keys and values, bf16, 8 rows)
    per_token = 2 * 4 * 64 * 2 * 8
    assert s.hbm_bytes_per_rank["kv cache"] == 12 * per_token * (256 + 4096)


def test_the_trace_streams_the_rings_tiles_not_the_contexts():
    from mkc.tags import KvTile
    from mkc.trace import CopyStart, build_trace
    s = check_spec(SPEC).ir
    tiles = {}
    for e in build_trace(s):
        if isinstance(e, CopyStart) and isinstance(e.tag, KvTile):
            tiles.setdefault(e.buffer.split("_kv_")[0], set()).add(e.tag.tile)
    assert max(tiles["swa"]) == 256 // 128 - 1
    assert max(tiles["gqa"]) > 2


def test_generated_module_sizes_the_ring_cache_and_passes_the_ring():
    from mkc.compiler import compile_spec
    text = compile_spec(SPEC).module_source
    assert "ring=256)" in text
    assert '"swa__key": ((len(KIND_LAYERS["swa"]), SEQS, 256, ' in text
    assert '"gqa__key": ((len(KIND_LAYERS["gqa"]), SEQS, CONTEXT, ' in text


@pytest.mark.parametrize("slots, verify, ok", [(135, 8, False), (128, 8, False), (144, 8, True),
                                               (128, None, True), (112, None, False)])
def test_the_check_needs_the_window_plus_the_verify_rows(tmp_path, slots, verify, ok):
    """W + R - 1 slots: a ring of 128 slots holds the 128-token window when decoding, not
    with a verify step of 8 rows a sequence (135 needed; slots in whole 16-token tiles)."""
    edits = [(RING, f"    kv ring {slots} slots\n"), _swa_tiles(16)]
    if verify is None:
        edits.append(("  verify  8\n", ""))
    path = _variant(tmp_path, *edits)
    if slots % 16:
        assert _error(path).code == "E-ALIGN"
        return
    if ok:
        check_spec(path)
        return
    d = _error(path)
    rows = verify or 1
    assert d.code == "E-KV-RING" and d.span.line == _line(path, f"kv ring {slots}")
    assert f"needs {ring_needs(128, rows)} slots" in d.message
    assert f"kv ring {-(-ring_needs(128, rows) // 16) * 16} slots" in d.hint


def test_a_ring_on_a_kind_without_a_window_is_refused_at_its_line(tmp_path):
    path = _variant(tmp_path, ("  phase gqa {\n", "  phase gqa {\n    kv ring 256 slots\n"))
    d = _error(path)
    assert d.code == "E-KV" and "gqa" in d.message and "whole context" in d.message
    assert d.span.line == _line(path, "  phase gqa {") + 1


def test_a_ring_not_of_whole_tiles_and_a_second_ring_are_refused(tmp_path):
    d = _error(_variant(tmp_path, (RING, "    kv ring 200 slots\n")))
    assert d.code == "E-ALIGN" and "200" in d.message and "128" in d.hint
    d = _error(_variant(tmp_path, (RING, RING + RING)))
    assert d.code == "E-DUPLICATE" and "kv ring" in d.message


def test_without_the_ring_the_context_limit_holds_and_the_tile_must_divide_the_context(tmp_path):
    d = _error(_variant(tmp_path, (RING, "")))
    assert d.code == "E-CONTEXT" and "kv ring" in d.hint
    # with the ring, the sliding kind's tile divides the ring, not the context
    path = _variant(tmp_path, (RING, "    kv ring 144 slots\n"), _swa_tiles(48))
    assert check_spec(path).ir.kinds["swa"].kv.ring == 144


def test_the_ring_reaches_resolve_after_its_pass(capsys):
    from mkc.cli import main
    main(["ir", str(SPEC), "--after", "kv_ring"])
    assert '"ring": 256' in capsys.readouterr().out


# ---- the ring holds its tiles: every accepted ring / tile combination traces ---------------
GRID_RINGS = (128, 256, 512)
GRID_TILES = [(slots, tokens, ahead) for tokens in (128, 256) for slots in (2, 4)
              for ahead in (1, 3) if ahead < slots]


def test_a_ring_shorter_than_its_tiles_is_refused_at_the_ring_line(tmp_path):
    """4 slots of 256 tokens stream 1024 positions: a ring of 512 would have its tiles started
    ahead copy from past its end (the module fails to trace: "Out of bound slice")."""
    path = _variant(tmp_path, (RING, "    kv ring 512 slots\n"),
                    _swa_tiles(256)[0:1] + (SWA_TILES.replace("2 slots of 128 tokens ahead 2",
                                                              "4 slots of 256 tokens ahead 3"),))
    d = _error(path, "gpt_oss_mini")
    assert d.code == "E-KV-RING" and d.span.line == _line(path, "kv ring 512 slots")
    assert "span 1024 positions" in d.message and "kv ring 1024 slots" in d.hint


def test_every_accepted_ring_and_tile_combination_traces(tmp_path):
    """A small grid of `kv ring` x `kv tiles` on the 20b spec (MINI GPT-OSS, window 128, verify
    8): mkc accepts a combination only where its module traces, and accepts some of each ring."""
    from conftest import run_python
    from mkc.compiler import compile_spec, module_name
    from mkc.files import write_atomically
    modules, accepted = [], {}
    for ring in GRID_RINGS:
        for slots, tokens, ahead in GRID_TILES:
            tiles = SWA_TILES.replace("2 slots of 128 tokens ahead 2",
                                      f"{slots} slots of {tokens} tokens ahead {ahead}")
            path = _variant(tmp_path, (RING, f"    kv ring {ring} slots\n"), (SWA_TILES, tiles))
            try:
                c = compile_spec(path, "gpt_oss_mini")
            except MkcError as e:
                assert all(d.span.file == str(path) for d in e.diagnostics)
                continue
            out = tmp_path / f"{module_name(c)}_{ring}_{slots}_{tokens}_{ahead}.py"
            write_atomically(out, c.module_source)
            modules += [str(out), "2"]
            accepted[str(out)] = (ring, slots, tokens, ahead)
    # 128 < window + verify rows; 256 holds two 128-token tiles, 512 four, or two of 256
    assert sorted(accepted.values()) == [(256, 2, 128, 1), (512, 2, 128, 1), (512, 2, 256, 1),
                                         (512, 4, 128, 1), (512, 4, 128, 3)]
    r = run_python(["tests/trace_worker.py", *modules], timeout=900)
    failed = [line for line in r.stdout.splitlines() if line.startswith("FAILED")]
    assert r.returncode == 0 and not failed, (failed, r.stderr[-2000:])
    assert r.stdout.count("TRACED") == len(accepted)

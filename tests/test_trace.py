"""The event trace: its size is bounded whatever the context or tile size, and the summarised KV
and weight streams have exactly the hazards of the fully unrolled ones."""
import itertools

import pytest

from mkc import trace
from mkc.checks.dma import check_dma
from mkc.compiler import check_spec
from mkc.diagnostics import MkcError
from mkc.lang.parser import parse
from mkc.resolve import resolve
from tests_support import SPEC

KV_LINE = "kv tiles 5 slots of 128 tokens ahead 5"


RING_LINE = "ring weights: 19 slots of bf16 tiles up to 1024 x 768"
STREAM_LINE = "stream weights ahead 19 {"


def _ir(tmp_path, slots: int, tokens: int, ahead: int, context: int,
        ring: tuple[int, int, int] = (12, 12, 1024)):
    ring_slots, ring_ahead, bound = ring
    # Decode steps only: the spec's verify step needs a context of at least its KV row window,
    # which some variants here (one 16-token tile) are shorter than.
    text = (SPEC.read_text().replace("verify  8 sequences 1 to 2\n", "")
            .replace(KV_LINE, f"kv tiles {slots} slots of {tokens} tokens ahead {ahead}")
            .replace("context 4096", f"context {context}")
            .replace(RING_LINE, f"ring weights: {ring_slots} slots of bf16 tiles up to {bound} x "
                                f"{bound}")
            .replace(STREAM_LINE, f"stream weights ahead {ring_ahead} {{"))
    assert f"context {context}" in text and f"up to {bound} x" in text and "\n  verify " not in text
    assert f"kv tiles {slots} slots of {tokens} tokens ahead {ahead}" in text
    return resolve(parse(text, str(tmp_path / "variant.sched")), "qwen3_8_mini")


def _hazards(s) -> set:
    return {(d.code, d.span.line) for d in check_dma(s, trace.build_trace(s))}


@pytest.mark.parametrize("slots,ahead", list(itertools.product((1, 2, 3), (1, 2, 3, 4))))
def test_summarised_kv_stream_has_the_hazards_of_the_whole_stream(tmp_path, monkeypatch, slots, ahead):
    for n_tiles in (1, 2, 5, 17, 40, 41):
        if n_tiles < ahead:     # its first tiles would be started past the cache: refused
            with pytest.raises(MkcError, match="start copies"):
                _ir(tmp_path, slots, 16, ahead, 16 * n_tiles)
            continue
        s = _ir(tmp_path, slots, 16, ahead, 16 * n_tiles)
        summarised = _hazards(s)
        with monkeypatch.context() as m:
            m.setattr(trace, "periodic_tiles_traced", lambda n, _slots, _ahead: n)
            whole = _hazards(s)
        assert summarised == whole, (slots, ahead, n_tiles)
        # a distance beyond the slot count clobbers a slot still filling, once there are more
        # tiles than slots: both must see it
        assert bool(whole) == (ahead > slots and n_tiles > slots), (slots, ahead, n_tiles, whole)


def test_trace_size_does_not_grow_with_context(tmp_path):
    sizes = [len(trace.build_trace(_ir(tmp_path, 2, 128, 1, context)))
             for context in (4096, 1 << 20, 1 << 24)]
    assert sizes[0] == sizes[1] == sizes[2]


def test_huge_context_is_rejected_by_hbm_before_any_trace(tmp_path, monkeypatch):
    import mkc.checks
    monkeypatch.setattr(mkc.checks, "build_trace", lambda s: pytest.fail("traced an infeasible spec"))
    spec = tmp_path / "huge_context.sched"
    spec.write_text(SPEC.read_text().replace("context 4096", "context 999999999872"))
    with pytest.raises(MkcError) as e:
        check_spec(spec)
    assert e.value.codes == ["E-HBM-CAPACITY"]


@pytest.mark.parametrize("slots,ahead", [(1, 1), (2, 1), (2, 2), (3, 2), (3, 4), (4, 4), (2, 5)])
def test_summarised_weight_stream_has_the_hazards_of_the_whole_stream(tmp_path, monkeypatch,
                                                                      slots, ahead):
    s = _ir(tmp_path, 2, 128, 1, 4096, ring=(slots, ahead, 128))     # 128 x 128: long runs
    summarised = trace.build_trace(s)
    with monkeypatch.context() as m:
        m.setattr(trace, "periodic_tiles_traced", lambda n, _slots, _ahead: n)
        whole = trace.build_trace(s)
        whole_hazards = {(d.code, d.span.line) for d in check_dma(s, whole)}
    assert len(summarised) < len(whole)              # the runs really were shortened
    assert {(d.code, d.span.line) for d in check_dma(s, summarised)} == whole_hazards
    assert bool(whole_hazards) == (ahead > slots), whole_hazards


def test_trace_size_does_not_grow_with_smaller_tiles(tmp_path):
    """Full Qwen 3.8 27B: halving the tile quadruples the tiles (about 280k at 128 x 128), but
    each run is cut to its warm-up, a period and its tail."""
    sizes = []
    for bound in (256, 128):
        s = resolve(parse(SPEC.read_text().replace(RING_LINE, f"ring weights: 4 slots of bf16 "
                                                   f"tiles up to {bound} x {bound}")
                          .replace(STREAM_LINE, "stream weights ahead 4 {"), str(SPEC)))
        sizes.append((s.stream.total_tiles, len(trace.build_trace(s))))
    assert sizes[1][0] > 3 * sizes[0][0]
    assert sizes[1][1] < sizes[0][1] * 1.2, sizes

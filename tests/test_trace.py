"""The event trace: its size is bounded whatever the context, and the summarised KV stream has
exactly the hazards of the fully unrolled one."""
import itertools

import pytest

from mkc import trace
from mkc.checks.dma import check_dma
from mkc.compiler import check_spec
from mkc.diagnostics import MkcError
from mkc.lang.parser import parse
from mkc.resolve import resolve
from tests_support import SPEC

KV_LINE = "kv tiles 2 slots of 128 tokens ahead 1"


def _ir(tmp_path, slots: int, tokens: int, ahead: int, context: int):
    text = SPEC.read_text().replace(KV_LINE, f"kv tiles {slots} slots of {tokens} tokens ahead "
                                             f"{ahead}").replace("context 4096", f"context {context}")
    assert f"context {context}" in text
    return resolve(parse(text, str(tmp_path / "variant.sched")), "qwen3_8_mini")


def _hazards(s) -> set:
    return {(d.code, d.span.line) for d in check_dma(s, trace.build_trace(s))}


@pytest.mark.parametrize("slots,ahead", list(itertools.product((1, 2, 3), (1, 2, 3, 4))))
def test_summarised_kv_stream_has_the_hazards_of_the_whole_stream(tmp_path, monkeypatch, slots, ahead):
    for n_tiles in (1, 2, 5, 17, 40, 41):
        s = _ir(tmp_path, slots, 16, ahead, 16 * n_tiles)
        summarised = _hazards(s)
        with monkeypatch.context() as m:
            m.setattr(trace, "kv_tiles_traced", lambda n, _slots, _ahead: n)
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

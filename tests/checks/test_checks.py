import dataclasses

import pytest

from mkc import ir
from mkc.checks import run_checks, vmem_budget
from mkc.checks.capacity import vmem_budget_bytes
from mkc.compiler import check_spec
from mkc.diagnostics import MkcError
from mkc.trace import CopyWait, Read, TraceOptions, build_trace
from tests_support import SPEC


@pytest.fixture(scope="module")
def full():
    return check_spec(SPEC).ir


def test_full_schedule_fits_vmem_with_padding(full):
    peak, where, live = vmem_budget(full, build_trace(full))
    assert peak <= vmem_budget_bytes(full)
    ring = full.buffer("weights")
    assert ring.vmem_bytes == full.stream.slots * full.stream.tile_rows * full.stream.tile_cols * 2
    assert any(b.cls == "state" for b in live)       # the peak sits inside the gdn scope


def test_padding_by_dtype():
    # as Mosaic tiles them (tests/checks/test_capacity.py pins the rules)
    assert ir.padded_bytes((1, 130), "bf16") == 2 * 256 * 2
    assert ir.padded_bytes((3, 128), "f32") == 4 * 128 * 4
    assert ir.padded_bytes((2, 5, 100), "int8") == 2 * 8 * 128


def test_trace_covers_every_layer_and_transition(full):
    events = build_trace(full)
    vector_waits = [e for e in events if isinstance(e, CopyWait) and e.sem[0] == "vectors"]
    assert len(vector_waits) == len(full.layer_kinds)
    tiles = [e for e in events if isinstance(e, Read) and e.buffer == "weights"]
    # the checks read each family's run cut to warm-up, a period and tail (tests/test_trace.py)
    assert [e.tag.index for e in tiles] == list(range(len(tiles)))
    whole = build_trace(full, TraceOptions(whole_runs=True))
    tiles = [e for e in whole if isinstance(e, Read) and e.buffer == "weights"]
    assert [e.tag.index for e in tiles] == list(range(full.stream.total_tiles))


def test_capacity_check_fails_when_limit_shrinks(full):
    small = dataclasses.replace(full, vmem_limit=16 << 20, vmem_reserve=4 << 20)
    with pytest.raises(MkcError) as e:
        run_checks(small)
    d = e.value.diagnostics[0]
    assert d.code == "E-VMEM-CAPACITY" and "weights" in "\n".join(d.notes)


def test_mini_derives_its_own_geometry():
    mini = check_spec(SPEC, "qwen3_8_mini").ir
    full = check_spec(SPEC).ir
    assert mini.stream.tile_rows < full.stream.tile_rows
    assert mini.stream.total_tiles < full.stream.total_tiles
    assert mini.layer_kinds == ["gdn", "gdn", "gdn", "gqa"] * 2


def test_checks_run_in_list_order_and_stop_before_the_trace(full, monkeypatch):
    """`run_checks` runs `CHECKS` in order: a failing check on the IR alone keeps the trace
    checks from running; a check only for sound specs is skipped once any check found a
    problem; every diagnostic found is raised together."""
    import mkc.checks
    from mkc.checks import CHECKS, Check
    from mkc.diagnostics import Diagnostic, Span
    assert [c.name for c in CHECKS][:5] == ["checkpoint", "hbm", "compiler_scratch", "buffer_fits",
                                            "kv_rings"]
    assert not any(c.reads_trace for c in CHECKS[:5]) and all(c.reads_trace for c in CHECKS[5:])
    assert len({c.name for c in CHECKS}) == len(CHECKS)
    ran = []

    def check(name, code=None, trace=False, sound=False):
        def run(s, *events):
            ran.append(name)
            return [Diagnostic(code, name, Span.unknown(s.source))] if code else []
        return Check(name, run, reads_trace=trace, only_if_sound=sound)

    monkeypatch.setattr(mkc.checks, "CHECKS", (check("a"), check("b", "E-A"), check("c", trace=True)))
    with pytest.raises(MkcError) as e:
        run_checks(full)
    assert ran == ["a", "b"] and e.value.codes == ["E-A"]
    ran.clear()
    monkeypatch.setattr(mkc.checks, "CHECKS", (check("a", trace=True), check("b", "E-B", trace=True),
                                               check("c", "E-C", trace=True, sound=True),
                                               check("d", "E-D", trace=True)))
    with pytest.raises(MkcError) as e:
        run_checks(full)
    assert ran == ["a", "b", "d"] and e.value.codes == ["E-B", "E-D"]


def test_the_checkpoint_check_reads_the_directory_the_model_pass_found(full, tmp_path):
    """`checks.checkpoint` reads `ScheduleIR.checkpoint` (set by resolve's model pass), never
    the spec: nothing for a config alone; for a directory whose safetensors do not hold the
    family's table, E-CHECKPOINT at the spec's `model` line."""
    from mkc.checks.checkpoint import check_checkpoint
    from mkc.model.config import CONFIG_DIR
    assert full.checkpoint == "" and check_checkpoint(full) == []
    (tmp_path / "config.json").write_text((CONFIG_DIR / "qwen3_8_27b.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (d,) = check_checkpoint(dataclasses.replace(full, checkpoint=str(tmp_path)))
    assert d.code == "E-CHECKPOINT" and d.span == full.setting_spans["model"], d

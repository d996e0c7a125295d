"""mkc.confirm: libtpu's VMEM verdict beside mkc's. The parsing runs everywhere; the compiles
(libtpu compile-only, ~10-30 s each for Qwen) are slow-tier."""
from pathlib import Path

import pytest

from mkc import confirm
from tests_support import SPEC

PROGRAM_OOM = """jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. \
Ran out of memory in memory space vmem. Used 64.34M of 63.94M vmem. Exceeded vmem capacity by 408.0K.

Program vmem requirement 64.34M:
    scoped           64.34M

  Largest program allocations in vmem:

  1. Size: 40.00M
     Operator: op_name="jit(step)/shard_map/pallas_call"
     Shape: bf16[16,1024,1280]{2,1,0:T(16,128)(2,1)}
     Unpadded size: 40.00M
     Tag: scratch operand
     Allocation type: scoped
     ==========================

  2. Size: 1.92M
     XLA label: register allocator spill slots in HLO :: shard_map.112
     Allocation type: scoped
     ==========================
"""

SCOPED_OOM = """RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:
Ran out of memory in memory space vmem while allocating on stack for %shard_map.112 = (...)
 Scoped allocation with size 32.05M and limit 32.00M exceeded scoped vmem limit by 47.0K. It
"""

MOSAIC_OOM = ("RESOURCE_EXHAUSTED: Allocation (size=71303168) would exceed memory "
              "(size=67108864) :: #allocation3 [shape = 'f32[17,1024,1024]']")


def test_parse_program_out_of_vmem():
    r = confirm.parse_compile_error(PROGRAM_OOM)
    assert r["libtpu"] == "out_of_vmem"
    assert r["used_bytes"] == round(64.34 * 2**20) and r["limit_bytes"] == round(63.94 * 2**20)
    assert [a["bytes"] for a in r["allocations"]] == [40 * 2**20, round(1.92 * 2**20)]
    assert r["allocations"][0]["shape"].startswith("bf16[16,1024,1280]")
    assert "spill" in r["allocations"][1]["tag"]


def test_parse_scoped_limit_and_single_allocation():
    r = confirm.parse_compile_error(SCOPED_OOM)
    assert r["libtpu"] == "out_of_vmem" and r["limit_bytes"] == 32 * 2**20
    r = confirm.parse_compile_error(MOSAIC_OOM)
    assert (r["libtpu"], r["used_bytes"], r["limit_bytes"]) == ("out_of_vmem", 71303168,
                                                                 67108864)


def test_parse_other_error():
    r = confirm.parse_compile_error("INTERNAL: Mosaic failed to compile TPU kernel: bad layout")
    assert r["libtpu"] == "error" and "bad layout" in r["message"]


def test_used_bytes_from_the_after_codegen_dump(tmp_path):
    (tmp_path / "module_0000.jit_step.after_codegen.txt").write_text(
        '  %x = f32[8] fusion(), backend_config={"used_scoped_memory_configs":[{"memory_space'
        '":"1","offset":"0","size":"99"}]}\n'
        '  %shard_map.1 = (f32[8]) custom-call(%a), custom_call_target="tpu_custom_call", '
        'frontend_attributes={kernel_metadata={\n"mesh_axes":"[]"\n}}, backend_config={'
        '"scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"67043328"}],'
        '"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"44470272"}]}\n'
        '  %y = f32[8] copy(%shard_map.1)\n')
    assert confirm._used_from_dump(str(tmp_path)) == (44470272, 67043328)


def test_confirmation_agreement_is_judged_at_the_compilers_limit():
    """libtpu is held to the limit, not to the reserve the user keeps on top of the model: a
    kernel in the reserve fits both; one past the limit agrees only with an out-of-VMEM."""
    mib = 2**20
    base = dict(spec="s", model="m", batch=8, topology="tpu7x=2x2x1", mkc_budget_bytes=58 * mib,
                mkc_limit_bytes=64 * mib, mkc_overhead_bytes=0, kernel="decode step, batch 8")
    fits, in_reserve, over = (dict(mkc_peak_bytes=n * mib, mkc_fits=n <= 58) for n in (50, 60, 65))
    assert confirm.VmemConfirmation(**base, **fits, libtpu="fits").agree
    assert not confirm.VmemConfirmation(**base, **fits, libtpu="out_of_vmem").agree
    assert confirm.VmemConfirmation(**base, **in_reserve, libtpu="fits").agree
    assert not confirm.VmemConfirmation(**base, **in_reserve, libtpu="out_of_vmem").agree
    assert confirm.VmemConfirmation(**base, **over, libtpu="out_of_vmem").agree
    r = confirm.VmemConfirmation(**base, **over, libtpu="fits")
    assert not r.agree and r.summary().endswith("DISAGREE") and "decode step, batch 8" in r.summary()
    assert not confirm.VmemConfirmation(**base, **over, libtpu="error").agree
    j = confirm.VmemConfirmation(**base, **fits, libtpu="fits").to_json()
    assert j["agree"] is True and j["libtpu"] == "fits"
    both = confirm.report([confirm.VmemConfirmation(**base, **fits, libtpu="fits"), r])
    assert both["agree"] is False and len(both["kernels"]) == 2


@pytest.mark.slow
def test_confirm_shipped_qwen_fits_on_both_sides():
    r = confirm.confirm_vmem(SPEC, batch=1, timeout=900)
    assert r.libtpu == "fits" and r.mkc_fits and r.agree, r.summary()
    assert r.limit_bytes == 67043328
    # the model is an upper bound, and a tight one
    assert r.used_bytes <= r.mkc_peak_bytes <= r.used_bytes + 2**20


@pytest.mark.slow
def test_confirm_the_issues_false_fit_is_now_rejected_by_both(tmp_path):
    text = Path(SPEC).read_text()
    for old, new in (("batch   1 to 8", "batch   1 to 16"),
                     ("reserve 6 MiB", "reserve 0 MiB"),
                     ("19 slots of bf16 tiles up to 1024 x 768", "16 slots of bf16 tiles up to 1024 x 1280"),
                     ("stream weights ahead 19", "stream weights ahead 16")):
        text = text.replace(old, new)
    spec = tmp_path / "qwen3_8_27b.sched"
    spec.write_text(text)
    r = confirm.confirm_vmem(spec, timeout=900)
    assert r.libtpu == "out_of_vmem" and not r.mkc_fits and r.agree, r.summary()
    assert r.used_bytes > r.limit_bytes


def test_check_confirm_exits_1_when_libtpu_disagrees(monkeypatch, capsys):
    """`mkc check --confirm` on a spec mkc passes: a kernel libtpu runs out of VMEM on is a
    disagreement, printed and exit status 1, never `ok` (libtpu's verdict stands in here for a
    compile; the compiles themselves are the slow tests below)."""
    from mkc.cli import main
    from mkc.compiler import check_spec
    from mkc.checks import capacity
    s = check_spec(SPEC).ir
    judged = capacity.kernels(s)

    def libtpu_says(verdict):
        def confirm_kernels(spec, model=None, timeout=900.0, progress=False):
            return [confirm.VmemConfirmation(
                spec=str(spec), model=s.model, batch=k.rows, topology=s.topology, kernel=str(k),
                mkc_fits=True, mkc_peak_bytes=1, mkc_budget_bytes=2, mkc_limit_bytes=3,
                mkc_overhead_bytes=0, libtpu=verdict if k == judged[-1] else "fits")
                for k in judged]
        monkeypatch.setattr(confirm, "confirm_kernels", confirm_kernels)

    libtpu_says("fits")
    assert main(["check", str(SPEC), "--confirm"]) == 0
    assert f"{SPEC}: ok" in capsys.readouterr().out
    libtpu_says("out_of_vmem")
    assert main(["check", str(SPEC), "--confirm"]) == 1
    out, err = capsys.readouterr()
    assert f"{SPEC}: ok" not in out and "libtpu disagrees" in out
    assert f"{judged[-1]} on" in err and err.rstrip().endswith("DISAGREE")


@pytest.mark.extended
def test_check_confirm_compiles_every_judged_kernel_of_the_issues_llama_case(tmp_path):
    """Llama 8B with 5 KV tiles of 512 tokens: mkc refuses its decode step at batch 8 (64.43
    MiB), libtpu runs out of VMEM on it ("Used 64.37M of 63.94M"), and both fit its verify
    steps of 8 and 16 rows: three compiles, all agreeing (about 90 s of CPU)."""
    from mkc.cli import main
    text = (Path(SPEC).parent / "llama_3_1_8b.sched").read_text()
    spec = tmp_path / "llama_3_1_8b.sched"
    spec.write_text(text.replace("kv tiles 4 slots of 256 tokens ahead 4",
                                 "kv tiles 5 slots of 512 tokens ahead 5"))
    rs = confirm.confirm_kernels(spec)
    assert [r.kernel for r in rs] == ["decode step, batch 8", "verify step, 8 rows (1 sequence of 8)",
                                      "verify step, 16 rows (2 sequences of 8)"]
    assert all(r.agree for r in rs), [r.summary() for r in rs]
    assert rs[0].libtpu == "out_of_vmem" and not rs[0].mkc_fits
    assert main(["check", str(spec)]) == 1

"""The generated kernels compile with libtpu for their compile-only topologies: the full-size
Qwen and Qwen3.5 MoE on tpu7x=2x2x1 (8 devices), Kimi K3 on tpu7x=2x2x4 (32 devices), Qwen on
v6e=2x4 (8 chips of one core), the replicated-heads layouts (Qwen on 16 tpu7x cores, K3 on
64), GPT-OSS 120b on tpu7x=2x2x1 and 20b on one chip (1x1x1), DeepSeek-V3 on tpu7x=2x2x2 (16
devices), Muse Spark on tpu7x=2x2x1, and the MINI Qwen kernel on every generation mkc compiles for."""
import pytest

from conftest import run_python
from mkc import compiler, files, target
from tests_support import SPEC


# Each family's first spec at batch 1 and 8; the layouts derived from one (another generation,
# replicated heads, a smaller slice or model of the family) at batch 8, the widest kernel and
# the one VMEM is closest at (batch 1 of each was compiled when it was added, and its verify
# step, where it has one, is compiled in tests/test_verify.py). Each compiles at mkc's VMEM
# boundary (benchmarks/vmem_sweep.py): the spec with its limit at mkc's own peak, or with the
# deepest weight ring mkc accepts at the chip's whole VMEM, a different one each day (the
# expert-format variants, Qwen3.5-35B-A3B's rounded FP8 and K3's FP8 and rounded FP4, at batch
# 1 or 8: one compile each, in turn); libtpu must fit it (no false fit), and the margin (mkc's
# peak minus libtpu's use) is printed.
FULL_SIZE = [("qwen3_8_27b", "decode B1"), ("qwen3_8_27b", "verify 8x2"),
             ("qwen3_5_35b_a3b", "decode B1"), ("qwen3_5_35b_a3b", "decode B8"),
             ("qwen3_5_35b_a3b fp8 experts", "decode B1 | decode B8"),
             ("kimi_k3", "decode B1"), ("kimi_k3", "decode B8"),
             ("kimi_k3 fp8 experts | kimi_k3 fp4 experts", "decode B1 | decode B8"),
             ("gpt_oss_120b", "decode B1"), ("gpt_oss_120b", "decode B8"),
             ("gpt_oss_20b", "decode B1"), ("gpt_oss_20b", "decode B8"),
             ("qwen3_5_397b_a17b", "decode B8"), ("qwen3_8_27b_v6e", "decode B8"),
             ("qwen3_8_27b_16", "decode B8"), ("kimi_k3_64", "decode B8"),
             ("llama_3_1_8b", "verify 8x2"), ("llama_3_1_70b", "verify 8x2"),
             ("deepseek_v3", "decode B1"), ("deepseek_v3", "decode B8"),
             ("muse_spark", "decode B1"), ("muse_spark", "decode B8"),
             # kernels past the shipped widths, and Llama 8B with 5 KV tiles of 512 tokens,
             # where its decode step at batch 8 outgrows its 16-row verify step
             ("llama_3_1_8b kv 512", "decode B8"), ("llama_3_1_8b", "decode B8"),
             ("llama_3_1_8b", "verify 8x4"), ("gpt_oss_20b", "decode B16"),
             ("gpt_oss_20b", "verify 8x2"), ("qwen3_235b_a22b", "verify 8x2"),
             ("deepseek_v3", "decode B16"), ("qwen3_235b_a22b", "verify 16x1"),
             ("muse_spark", "verify 16x1"), ("kimi_k3", "verify 16x1")]
# CI compiles each family's widest kernel of its first spec, and one more of the others a day,
# in turn; the extended tier compiles them all.
IN_CI = [("qwen3_8_27b", "verify 8x2"), ("qwen3_5_35b_a3b", "decode B8"),
         ("kimi_k3", "decode B8"), ("gpt_oss_120b", "decode B8"), ("llama_3_1_8b", "verify 8x2"),
         ("deepseek_v3", "decode B8"), ("llama_3_1_8b kv 512", "decode B8"), ("muse_spark", "decode B8")]
ROTATING = [case for case in FULL_SIZE if case not in IN_CI]


def _today() -> int:
    import datetime
    return datetime.date.today().toordinal()


def _full_size_params() -> list:
    today = ROTATING[_today() % len(ROTATING)]
    return [pytest.param(*case, marks=() if case in IN_CI or case == today
                         else pytest.mark.extended) for case in FULL_SIZE]


@pytest.mark.slow
@pytest.mark.parametrize("name, width", _full_size_params())
def test_full_size_kernel_fits_where_mkc_says_it_fits(name, width):
    import sys
    sys.path.insert(0, str(SPEC.parent.parent / "benchmarks"))
    import vmem_sweep
    day = _today() + FULL_SIZE.index((name, width))
    kind = vmem_sweep.FITTING_KINDS[day % len(vmem_sweep.FITTING_KINDS)]
    # format variants: one variant and width a day, in turn, each at every kind
    turns = [(n, w) for w in width.split(" | ") for n in name.split(" | ")]
    name, width = turns[day // len(vmem_sweep.FITTING_KINDS) % len(turns)]
    v = vmem_sweep.boundary_variant(name, width, kind)
    mkc = vmem_sweep.mkc_view(v)
    assert mkc["fits"], mkc
    r = vmem_sweep.compile_variant(v, timeout=900)
    assert r["libtpu"] == "fits", (v.name, mkc, r)        # libtpu's verdict: mkc's fit is real
    margin = (mkc["peak"] - r["used_bytes"]) / 2**20
    print(f"{v.name}: mkc {mkc['peak'] / 2**20:.2f} MiB, libtpu {r['used_bytes'] / 2**20:.2f} "
          f"MiB, margin {margin:+.2f} MiB")
    assert margin >= -1 / 1024, (v.name, margin)       # never under libtpu's use by a KiB
    if kind == "ring N" and mkc["measured"]:
        # at the chip's whole VMEM, where the scratch was measured; under a limit at mkc's peak
        # libtpu spills less (Qwen's verify step: 33.91 MiB at 35.92, 35.86 at 63.94); less
        # what the scratch's envelope adds over this width's own measure, a bound by design
        assert margin - mkc["envelope_over_measure"] / 2**20 <= 1.0, (v.name, margin)


# An 8-rank slice of each generation (the MINI config's 8 heads divide over it).
MINI_GRIDS = {"v4": "2x2x1", "v5e": "2x4", "v5p": "2x2x2", "v6e": "2x4", "tpu7x": "2x2x1"}


def mini_spec_for(generation: str, grid: str) -> str:
    """The Qwen spec retargeted: its VMEM limit capped at the generation's VMEM (and its 1 MiB
    headroom expectation, a promise about the shipped target, dropped where the VMEM is
    smaller), and a direct all-reduce where a chip is one rank (no sibling level)."""
    chip = target.chip(generation)
    t = target.topology(generation, tuple(int(d) for d in grid.split("x")))
    mib = min(64, chip.vmem_bytes >> 20)
    text = SPEC.read_text().replace("target  tpu7x topology 2x2x1",
                                    f"target  {generation} topology {grid}")
    text = text.replace("tp = 8", f"tp = {t.num_cores}")
    text = text.replace("limit 64 MiB reserve 6 MiB",
                        f"limit {mib} MiB reserve {6 if mib >= 64 else 2} MiB")
    if mib < 64:
        text = text.replace("  expect vmem headroom at least 1 MiB\n", "")
    return text if chip.cores_per_chip > 1 else text.replace("two_level chip", "direct")


def test_every_generation_has_a_mini_compile():
    assert sorted(MINI_GRIDS) == sorted(target.known_chips())


@pytest.mark.slow
@pytest.mark.parametrize("generation", sorted(MINI_GRIDS))
def test_mini_kernel_compiles_for_each_generation(generation, tmp_path):
    """The MINI geometry (the one the interpret tests run) lowers through Mosaic and compiles
    with libtpu on each generation's 8-rank slice (about 5 s each)."""
    grid = MINI_GRIDS[generation]
    spec = tmp_path / "qwen3_8_27b.sched"
    spec.write_text(mini_spec_for(generation, grid))
    c = compiler.compile_spec(spec, "qwen3_8_mini")
    out = tmp_path / f"{compiler.module_name(c)}.py"
    files.write_atomically(out, c.module_source)
    r = run_python(["benchmarks/tpu_compile.py", str(out), "2"], timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert f"compiled for {target.generation(generation).prefix}={grid}" in r.stdout


def test_tpu_compile_refuses_a_module_whose_ranks_are_not_the_topologys(tmp_path):
    """A module edited (or compiled) for another rank count is a clear error, not a traceback
    from the mesh."""
    src = (SPEC.parent.parent / "generated" / "qwen3_8_27b_v6e__qwen3_8_27b.py").read_text()
    assert "\nRANKS = 8\n" in src
    out = tmp_path / "wrong_ranks.py"
    out.write_text(src.replace("\nRANKS = 8\n", "\nRANKS = 4\n"))
    r = run_python(["benchmarks/tpu_compile.py", str(out), "1"], timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "runs on 4 ranks but topology v6e=2x4 has 8 devices" in r.stderr


@pytest.mark.slow
def test_every_generation_compiles_every_expert_format():
    """Measured, not assumed: the K3 lowering's expert-matmul body in each weight format
    (MXFP4 decode, FP8 with 32-row scales, FP8 with a scale per pack group) compiles with
    libtpu on every generation (benchmarks/format_probe.py), so no target refuses a format;
    FP8 codes fed to the MXU as they are compile exactly where the target table says the
    MXU takes FP8 operands (v4's Mosaic refuses them: there the codes are converted first);
    FP4 codes (`fp4 block N`) exactly where it says the MXU takes FP4 (tpu7x only: the spec
    check refuses fp4 elsewhere)."""
    r = run_python(["benchmarks/format_probe.py"], timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if ": " in ln]
    assert len(lines) == 5 * len(target.known_chips())
    formats = [ln for ln in lines if " fp8 codes: " not in ln and " fp4 block: " not in ln]
    assert all(ln.endswith(": compiles") for ln in formats), formats
    for chip in target.known_chips():
        codes = next(ln for ln in lines if ln.startswith(f"{chip} fp8 codes: "))
        assert codes.endswith(": compiles") == target.generation(chip).fp8_operand, codes
        fp4 = next(ln for ln in lines if ln.startswith(f"{chip} fp4 block: "))
        assert fp4.endswith(": compiles") == target.generation(chip).fp4_operand, fp4
    assert [c for c in target.known_chips() if target.generation(c).fp4_operand] == ["tpu7x"]


@pytest.mark.slow
def test_int4_and_nvfp4_expert_matmul_compile_for_tpu7x():
    """The lowered expert matmul in `int4 block 128` and `nvfp4` at Muse Spark's per-rank
    expert shapes (batch 1 and 8), and each pack-group formulation compared in docs/formats.md,
    compile with libtpu for tpu7x (benchmarks/expert_matmul_compile.py); on v6e int4 compiles
    and nvfp4 fails, as `Generation.fp4_operand` (which the spec check applies to nvfp4) says."""
    r = run_python(["benchmarks/expert_matmul_compile.py", "tpu7x", "v6e"], timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    lines = [ln for ln in r.stdout.splitlines() if ": " in ln]
    tpu7x = [ln for ln in lines if ln.startswith("tpu7x ")]
    assert len(tpu7x) == 18 and all(ln.endswith(": compiles") for ln in tpu7x), tpu7x
    assert any(ln.startswith("v6e nvfp4 4096") and "f4E2M1FN" in ln for ln in lines), lines

"""generated/ is exactly what the compiler makes from schedules/, byte for byte."""

from mkc import compiler
from tests_support import ROOT

SCHEDULES = sorted((ROOT / "schedules").glob("*.sched"))


def test_every_schedule_has_a_fresh_generated_module():
    assert SCHEDULES
    for spec in SCHEDULES:
        c = compiler.compile_spec(spec)
        out = ROOT / "generated" / f"{compiler.module_name(c)}.py"
        assert out.exists(), f"{out} missing: run `./dev compile`"
        assert out.read_text() == c.module_source, f"{out} is stale: run `./dev compile`"


def test_compile_is_deterministic():
    a = compiler.compile_spec(SCHEDULES[0]).module_source
    b = compiler.compile_spec(SCHEDULES[0]).module_source
    assert a == b
    compile(a, "generated.py", "exec")


def test_generated_module_declares_its_schedule():
    src = (ROOT / "generated" / "qwen3_8_27b.py").read_text()
    assert "pl.pallas_call(" in src and "vmem_limit_bytes=VMEM_LIMIT_BYTES" in src
    assert "collective_id=0" in src and "jax.shard_map(" in src
    assert "def pack_weights(" in src and "def init_state(" in src
    assert "k.allreduce(" in src and "collectives.barrier(AXIS, RANKS)" in src


def test_generic_module_reads_like_code():
    """The generic module names semaphores, buffers and streamed matrices (no positional
    `sems.at[3]` or `_stream_matmul(..., 5, 2, 1024, 1152)`), keeps values in locals (no
    `v["h"]`), wraps its constants, and points every state copy back at its spec line."""
    src = (ROOT / "generated" / "qwen3_8_27b.py").read_text()
    assert "sems.at[" not in src and "_stream_matmul(" not in src and 'v["' not in src
    assert max(len(line) for line in src.splitlines()) <= 110
    copies = [line for line in src.splitlines() if 'c.copy("' in line and line.rstrip().endswith(")")]
    assert copies and all("# spec line " in line for line in copies
                          if line.rstrip().endswith((".start()", ".wait()")) and "previous" not in line)
    assert "h = lower.input_norm(c)" in src and "proj = lower.in_proj(c, h)" in src


def test_free_text_from_inputs_cannot_break_the_module(tmp_path):
    """A model directory name with quotes reaches only a sanitised name, never raw source."""
    weird = tmp_path / 'evil"""\nimport os'
    weird.mkdir()
    (weird / "config.json").write_text(
        (ROOT / "mkc/model/configs/qwen3_8_mini.json").read_text())
    c = compiler.compile_spec(ROOT / "schedules" / "qwen3_8_27b.sched", str(weird))
    compile(c.module_source, "generated.py", "exec")
    assert '"""\nimport os' not in c.module_source
    assert compiler.module_name(c).isidentifier()


"""The full-size generated Qwen kernel compiles with libtpu for compile-only tpu7x=2x2x1."""
import pytest

from conftest import run_python


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8])
def test_full_size_kernel_compiles_for_tpu7x(batch):
    r = run_python(["benchmarks/tpu_compile.py", "generated/qwen3_8_27b.py", str(batch)],
                   timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "compiled for tpu7x=2x2x1" in r.stdout


@pytest.mark.slow
def test_mini_kernel_compiles_for_tpu7x(tmp_path):
    """The MINI geometry (the one the interpret tests run) also lowers through Mosaic."""
    from mkc import compiler
    from tests_support import SPEC
    c = compiler.compile_spec(SPEC, "qwen3_8_mini")
    out = tmp_path / f"{compiler.module_name(c)}.py"
    compiler.write_atomically(out, c.module_source)
    r = run_python(["benchmarks/tpu_compile.py", str(out), "2"], timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "compiled for tpu7x=2x2x1" in r.stdout

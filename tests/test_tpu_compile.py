"""The full-size generated kernels compile with libtpu for their compile-only topologies: Qwen
and Qwen3.5 MoE on tpu7x=2x2x1 (8 devices), Kimi K3 on tpu7x=2x2x4 (32 devices)."""
import pytest

from conftest import run_python


@pytest.mark.slow
@pytest.mark.parametrize("module, topology", [("qwen3_8_27b", "tpu7x=2x2x1"),
                                              ("qwen3_5_35b_a3b", "tpu7x=2x2x1"),
                                              ("qwen3_5_397b_a17b", "tpu7x=2x2x2"),
                                              ("kimi_k3", "tpu7x=2x2x4")])
@pytest.mark.parametrize("batch", [1, 8])
def test_full_size_kernel_compiles_for_tpu7x(module, topology, batch):
    r = run_python(["benchmarks/tpu_compile.py", f"generated/{module}.py", str(batch)],
                   timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert f"compiled for {topology}" in r.stdout


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

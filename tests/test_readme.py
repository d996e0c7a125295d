"""Doc test: the README's "Using a generated module" section runs as written.

Its shell block (the `mkc compile` line, into the ignored `scratch/`) and then its python block
run verbatim in a fresh directory, the python saved beside the module's folder and run from the
directory in a fresh interpreter on CPU with nothing set but `JAX_PLATFORMS=cpu`: the snippet
sets the device count itself. `schedules/` is linked into the directory and the
venv's `mkc` is on PATH, as for a reader in the repository's root.
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests_support import ROOT

HEADING = "## Using a generated module"


def readme_blocks() -> tuple[str, str]:
    """The (shell, python) blocks of the README's section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(HEADING):]
    section = section[:section.find("\n## ", 1)]
    sh = re.search(r"```sh\n(.*?)```", section, re.S)
    py = re.search(r"```python\n(.*?)```", section, re.S)
    assert sh and py, f"a sh and a python block under {HEADING!r}"
    return sh.group(1), py.group(1)


def test_readme_shell_block_is_one_compile_into_the_module_the_snippet_imports():
    sh, py = readme_blocks()
    argv = shlex.split(sh.strip())
    assert argv[:2] == [".venv/bin/mkc", "compile"], argv
    out = Path(argv[argv.index("-o") + 1])
    assert out.parent == Path("scratch"), "the module goes into the ignored scratch folder"
    m = re.search(rf"^import {out.name}\.(\w+) as \w+", py, re.M)
    assert m, f"the snippet imports a module from {out}/ (beside it in {out.parent}/)"
    spec, model = Path(argv[2]).stem, argv[argv.index("--model") + 1]
    assert m.group(1) == f"{spec}__{model}", "the README's naming rule and the import agree"


@pytest.mark.slow
def test_readme_generated_module_snippet_runs(tmp_path):
    sh, py = readme_blocks()
    (tmp_path / "schedules").symlink_to(ROOT / "schedules")
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env |= {"JAX_PLATFORMS": "cpu", "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"}
    # `.venv/bin/mkc` as a reader types it, run with this interpreter's venv.
    argv = shlex.split(sh.strip())
    argv = [sys.executable, "-m", "mkc", *argv[1:]]
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # saved beside the module's folder and run from the root, as the README says
    snippet = Path(argv[argv.index("-o") + 1]).parent / "readme_snippet.py"
    (tmp_path / snippet).write_text(py)
    r = subprocess.run([sys.executable, str(snippet)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    steps = re.findall(r"^step (\d) next tokens \[(\d+) (\d+)\]$", r.stdout, re.M)
    assert [s[0] for s in steps] == ["0", "1"], r.stdout
    # init_state's host arrays are placed before the step donates them: no JAX warning
    assert "donated buffers were not usable" not in r.stderr, r.stderr[-2000:]


def test_a_mesh_of_the_wrong_size_names_the_device_flag(tmp_path):
    """What a reader who forgot XLA_FLAGS meets: a ValueError naming it, not JAX's shard-shape
    error from inside sharding."""
    from mkc import compiler
    c = compiler.compile_spec(ROOT / "schedules" / "qwen3_8_27b.sched", "qwen3_8_mini")
    (tmp_path / "mod.py").write_text(c.module_source)
    script = ("import mod, jax, numpy as np\nfrom jax.sharding import Mesh\n"
              "mesh = Mesh(np.array(jax.devices()[:1]), (mod.AXIS,))\n"
              "try:\n    mod.place_weights({}, mesh)\nexcept ValueError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"of {c.ir.ranks} devices" in r.stdout and \
        f"--xla_force_host_platform_device_count={c.ir.ranks}" in r.stdout, r.stdout

"""Doc test: the README's "Using a generated module" snippet runs as written.

The python block under that heading is run verbatim in a fresh interpreter on CPU, with the
device count it needs (`XLA_FLAGS=--xla_force_host_platform_device_count=RANKS`), against the
MINI config compiled from the same spec into a temporary `generated/` package under the module
name the snippet imports. Before it, a preamble defines the names the README says the reader
provides: `hf_params` (small random HF-named weights from `mkc.families.qwen3_5.reference.init_params`),
`B`, `tokens`, `positions`, and `interpret` (interpret mode with eager DMAs, as on CPU).
"""
import json
import os
import re
import subprocess
import sys

import pytest

from tests_support import ROOT

HEADING = "## Using a generated module"
MODEL = "qwen3_8_mini"

PREAMBLE = f"""\
# The names the README's snippet expects the reader to provide.
import json
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from mkc.families.qwen3_5 import reference as qwen3_5

_config = json.loads(open({str(ROOT / "mkc/model/configs" / (MODEL + ".json"))!r}).read())
hf_params = qwen3_5.init_params(qwen3_5.load_config(_config), seed=0)
B = 2
tokens = jnp.array([3, 1000], jnp.int32)
positions = jnp.array([0, 9], jnp.int32)
interpret = pltpu.InterpretParams(dma_execution_mode="eager")
"""

EPILOGUE = """
# The snippet's results: logits over the whole vocabulary and a next token per row.
import numpy as _np
assert logits.shape == (B, _config["vocab_size"]), logits.shape
assert _np.isfinite(_np.asarray(logits)).all()
assert next_token.shape == (B,)
print("README snippet ran")
"""


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(HEADING):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, f"no python block under {HEADING!r}"
    return m.group(1)


@pytest.mark.slow
def test_readme_generated_module_snippet_runs(tmp_path):
    from mkc import compiler
    snippet = readme_snippet()
    m = re.search(r"^import generated\.(\w+) as \w+", snippet, re.M)
    assert m, "the snippet imports a module from generated/"
    c = compiler.compile_spec(ROOT / "schedules" / f"{m.group(1)}.sched", MODEL)
    package = tmp_path / "generated"
    package.mkdir()
    (package / "__init__.py").write_text("")
    compiler.write_atomically(package / f"{m.group(1)}.py", c.module_source)
    script = tmp_path / "readme_snippet.py"
    script.write_text(PREAMBLE + "\n# ---- the README snippet, verbatim ----\n" + snippet + EPILOGUE)
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={c.ir.ranks}")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "README snippet ran" in r.stdout
    json.dumps(r.stdout)   # the run printed only text

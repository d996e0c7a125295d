"""Compile a spec for a model into a temporary directory and import the generated module."""
from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from mkc import compiler


def load_generated(spec: Path, model: str):
    """Compile `spec` for `model` and import the generated module."""
    c = compiler.compile_spec(spec, model)
    out = Path(tempfile.mkdtemp(prefix="mkc-")) / f"{compiler.module_name(c)}.py"
    compiler.write_atomically(out, c.module_source)
    mod_spec = importlib.util.spec_from_file_location(out.stem, out)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module

"""Shared by the MINI run scripts: compile a spec for a model into a temporary directory and
import the generated module; finish a run's summary."""
from __future__ import annotations

import importlib.util
import json
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


ROOT = Path(__file__).resolve().parents[1]


def k3_mini_spec() -> Path:
    """The shipped K3 spec on 2 hosts (tpu7x 2x2x2, 16 cores), for the MINI config (16 heads):
    the topology change re-derives per-rank shapes and collective groups."""
    text = (ROOT / "schedules" / "kimi_k3.sched").read_text()
    text = text.replace("topology 2x2x4", "topology 2x2x2").replace("tp = 32", "tp = 16")
    path = Path(tempfile.mkdtemp(prefix="mkc-k3-")) / "kimi_k3.sched"
    path.write_text(text)
    return path


def finish(summary: dict, races: bool, as_json: bool) -> None:
    """Add the race detector's verdict (when it ran) and print the JSON summary (if asked)."""
    if races:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
        summary["races_found"] = bool(ipc.races.races_found)
        print(f"races found: {summary['races_found']}")
    if as_json:
        print("JSON " + json.dumps(summary))

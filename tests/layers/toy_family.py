"""A family outside mkc, for the tests that compose library kinds into one (docs/extending.md,
"A new layer kind"): its package written from module sources, a MINI config and a spec made
from shipped ones, registered for the test; and `examples/run_mini.py` run on it, its kernel
judged bit-equal to the rounding emulation."""
from __future__ import annotations

import functools
import importlib
import json
import shutil
import sys
import textwrap
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mkc.model import registry
from mkc.model.config import CONFIG_DIR
from tests_support import ROOT

# Registers the family, runs `patch` (a test's edit of the library, e.g. a mutant of a decode),
# then runs examples/run_mini.py as its own main.
RUNNER = '''
import functools, runpy, sys
sys.path.insert(0, {root!r})
from mkc.model import registry
import {name}
known = registry._registry
registry._registry = functools.cache(lambda: {{**known(), "{name}": {name}.FAMILY}})
{patch}
sys.argv = ["run_mini.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
'''


def write_package(root: Path, package: str, files: Mapping[str, str]) -> None:
    (root / package).mkdir(parents=True)
    for name, text in files.items():
        (root / package / name).write_text(textwrap.dedent(text).lstrip())


def write_family(root: Path, name: str, files: Mapping[str, str], config: str, schedule: str,
                 config_changes: Mapping = {}, replacements: Iterable[tuple[str, str]] = (),
                 scratch_of: str = "llama") -> Path:
    """The package `name` under `root` (with `scratch_of`'s compiler scratch measures: a geometry
    it has not measured is counted at 1.5x the family's largest), the shipped MINI `config` as
    its model, and the shipped `schedule` on it with `replacements`; the spec's path."""
    write_package(root, name, files)
    shutil.copy(ROOT / f"mkc/families/{scratch_of}/compiler_scratch.json", root / name)
    raw = json.loads((CONFIG_DIR / f"{config}.json").read_text()) | {"model_type": name, **config_changes}
    (root / "toy_mini.json").write_text(json.dumps(raw))
    spec = (ROOT / "schedules" / f"{schedule}.sched").read_text()
    for old, new in ((f'model   "{schedule}"', f'model   "{root / "toy_mini.json"}"'),
                     (f"schedule {schedule}", "schedule toy_mini"), *replacements):
        assert old in spec, old
        spec = spec.replace(old, new)
    (root / "toy_mini.sched").write_text(spec)
    return root / "toy_mini.sched"


def registered(monkeypatch, root: Path, name: str, value: Any) -> Iterator[Any]:
    """For a fixture to `yield from` (yielding `value`): the packages under `root` importable and
    the family `name` registered while the test runs; its modules forgotten after."""
    monkeypatch.syspath_prepend(str(root))
    family = importlib.import_module(name).FAMILY
    known = registry._registry
    monkeypatch.setattr(registry, "_registry", functools.cache(lambda: {**known(), name: family}))
    yield value
    for module in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[module]


def run_mini(spec: Path, name: str, *args: str, timeout: float = 1800, patch: str = "",
             rejected: bool = False) -> dict:
    """`examples/run_mini.py` on the family's spec from a checkpoint of its reference's random
    weights, `args` after; its JSON summary, every step's logits bit-equal to the emulation's.
    With `patch` (Python run in the runner first: an edit of the library) and `rejected`, the
    run must fail instead: some step's logits off the emulation's, a failure reported."""
    from conftest import run_python

    from mkc.checkpoint import save_checkpoint
    root = spec.parent
    reference = importlib.import_module(f"{name}.reference")
    config = json.loads((root / "toy_mini.json").read_text())
    if not (root / "checkpoint").exists():
        save_checkpoint(root / "checkpoint", config, reference.init_params(reference.load_config(config), 0))
    runner = root / "run_toy.py"
    runner.write_text(RUNNER.format(root=str(root), name=name, script=str(ROOT / "examples/run_mini.py"),
                                    patch=patch))
    r = run_python([str(runner), "--json", "--spec", str(spec), "--checkpoint", str(root / "checkpoint"),
                    *args], timeout=timeout)
    assert r.returncode == (1 if rejected else 0), r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("JSON "))[5:])
    assert summary["emulation_check"] == "exact"
    if rejected:
        assert summary["failures"] and any(s["emulation"]["logits"] != 0.0 for s in summary["steps"])
        return summary
    assert all(s["emulation"]["logits"] == 0.0 for s in summary["steps"])
    return summary

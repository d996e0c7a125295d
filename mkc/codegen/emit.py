"""Lower the checked schedule IR to one readable Pallas module through the generic jinja2
template (`templates/module.py.j2`), whatever the model family."""
from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

import jinja2

import mkc
from mkc import ir
from mkc.codegen import generic

_TEMPLATES = Path(__file__).with_name("templates")


@functools.cache          # templates compile once a process (0.2 s), not once a module
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(_TEMPLATES), autoescape=False,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    # Free text (file names) only reaches the module docstring, restricted to safe characters.
    env.filters["safe_text"] = lambda t: re.sub(r"[^A-Za-z0-9_.\-]", "_", str(t))
    # Whether generated text uses a name (an import or a local is emitted only if it does).
    env.tests["using"] = lambda text, name: re.search(rf"(?<![\w.]){re.escape(name)}\b", text) is not None
    return env


def render(s: ir.ScheduleIR, spec_text: str) -> str:
    """The generated module's source; deterministic for the same inputs."""
    digest = hashlib.sha256((spec_text + "\0" + s.config_digest + "\0" + mkc.__version__)
                            .encode()).hexdigest()[:16]
    return _env().get_template("module.py.j2").render(
        s=s, version=mkc.__version__, digest=digest, **generic.context(s))

"""How a spec's names are judged: identifiers that become generated names, names that must be
one of a known set, and header settings a schedule must have."""
from __future__ import annotations

import builtins
import keyword
import re
import sys
from typing import TYPE_CHECKING

from mkc.diagnostics import MkcError, did_you_mean, fail
from mkc.lang import ast
from mkc.model.graph import DecodeGraph

if TYPE_CHECKING:
    from mkc.resolve.state import ResolveState

# No "__": generated code joins names with a double underscore, so user names cannot collide.
IDENT = re.compile(r"^[a-z](?:_?[a-z0-9])*$")
# Names the generated module defines itself; a spec buffer may not shadow them.
# (A family's VMEM activations, e.g. K3's `blocks`, are reserved too: see validate_identifier.)
RESERVED = {"x", "stage", "acc", "ring", "vectors", "logits", "state", "start", "end",
            "embed", "embed_rows", "head_norm", "tables", "tokens", "positions", "rope",
            "ring_hbm", "vectors_hbm", "head_norm_hbm", "ring_sem", "vectors_sem", "sems",
            "send_sem", "recv_sem", "collective_count", "tile_class", "pool_sem", "expert_sem",
            "experts_hbm", "expert_list", "expert_count"}
MAX_NAME = 64          # a schedule's name becomes a file name, with the model's appended


def unknown(what: str, name: ast.Name, options: list[str], notes: list[str] | None = None
            ) -> MkcError:
    return fail("E-UNKNOWN", f"unknown {what} '{name.text}'", name.span,
                hint=did_you_mean(name.text, options) + f"known: {', '.join(options) or 'none'}",
                notes=notes)


def require(sched: ast.Schedule, key: str, example: str) -> ast.Setting:
    if key not in sched.settings:
        raise fail("E-MISSING", f"the schedule does not set '{key}'", sched.name.span,
                   hint=f"add a line like `{example}`")
    return sched.settings[key]


def validate_identifier(name: ast.Name, what: str, graph: DecodeGraph | None = None) -> str:
    """A spec name that becomes a generated identifier; with the graph, the family's VMEM
    activation buffers are taken too."""
    text = name.text
    reserved = RESERVED | (set(graph.activations) if graph is not None else set())
    if not IDENT.match(text) or keyword.iskeyword(text) or text in reserved:
        raise fail("E-NAME", f"'{text}' cannot name a {what}", name.span,
                   hint="use lower-case letters and digits joined by single '_', starting with "
                        "a letter, not a Python keyword or one of: "
                        + ", ".join(sorted(reserved)))
    return text


def validate_module_name(name: ast.Name) -> str:
    """The schedule's name becomes a Python module (`generated/NAME.py`): it must be importable
    and must not shadow the standard library, a builtin or what the module itself imports."""
    text = name.text
    taken = (keyword.iskeyword(text) or keyword.issoftkeyword(text)
             or text in sys.stdlib_module_names or text in dir(builtins)
             or text in ("mkc", "jax", "jaxlib", "numpy", "ml_dtypes", "generated"))
    if not IDENT.match(text) or taken or len(text) > MAX_NAME:
        raise fail("E-NAME", f"'{text}' cannot name a schedule: it becomes the generated module's "
                   "name" + (", which would shadow a module or name Python already has" if taken
                             else ""), name.span,
                   hint=f"use at most {MAX_NAME} lower-case letters and digits joined by single "
                        "'_', starting with a letter, e.g. `schedule qwen_decode`")
    return text


def unused_kind(s: ResolveState, name: str) -> bool:
    """Whether `name` is a layer kind of the family that this model's layers do not run (Muse
    Spark's `moe_bf16` in its bf16 checkpoint): a spec may serve every checkpoint of a family,
    so its phase and stream and view entries are skipped, not refused."""
    return name not in s.graph.kinds and name in (s.family.layers or {})

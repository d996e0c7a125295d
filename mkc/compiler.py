"""The pipeline in one place: parse -> resolve -> checks -> codegen, and atomic output."""
from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from typing import TYPE_CHECKING

from mkc.diagnostics import MkcError

if TYPE_CHECKING:
    from mkc import ir

# Each stage is imported when the pipeline reaches it: a spec with a syntax error is reported
# before resolve (networkx, numpy) or codegen (JAX, through the runtime it emits calls to) load.


@dataclass
class Compiled:
    ir: ir.ScheduleIR
    spec_text: str
    module_source: str | None = None
    events: list = field(default_factory=list, repr=False)   # the checked trace


def check_spec(spec: str | Path, model: str | None = None) -> Compiled:
    """Parse, resolve and check; raises MkcError with diagnostics on a bad spec."""
    from mkc.lang.parser import parse_file
    sched, text = parse_file(spec)
    return _check_parsed(sched, text, model)


def check_source(text: str, file: str, model: str | None = None) -> Compiled:
    """`check_spec` of a spec's text (an editor's unsaved buffer); `file` names it in
    diagnostics and anchors a relative `model` path."""
    from mkc.lang.parser import parse
    return _check_parsed(parse(text, file), text, model)


def _check_parsed(sched, text: str, model: str | None = None) -> Compiled:
    from mkc.resolve import resolve, with_smallest_topology
    schedule_ir = resolve(sched, model)
    from mkc.checks import run_checks
    try:
        events = run_checks(schedule_ir)
    except MkcError as e:
        # HBM is the one capacity a bigger slice of the same generation fixes: name the
        # smallest that would do.
        for d in e.diagnostics:
            if d.code == "E-HBM-CAPACITY":
                d.hint = with_smallest_topology(d.hint, sched, model)
        raise
    return Compiled(schedule_ir, text, events=events)


def compile_spec(spec: str | Path, model: str | None = None) -> Compiled:
    c = check_spec(spec, model)
    from mkc.codegen.emit import render
    c.module_source = render(c.ir, c.spec_text)
    return c


def module_name(c: Compiled) -> str:
    """`NAME` or `NAME__MODEL`; a long model name (a checkpoint directory's) is cut and given
    a digest, so the file name stays within what file systems allow."""
    if c.ir.model == c.ir.name:
        return c.ir.name
    model = c.ir.model
    if len(model) > 48:
        model = f"{model[:32]}_{hashlib.sha256(model.encode()).hexdigest()[:12]}"
    return f"{c.ir.name}__{model}"


NOT_REPLACEABLE = "exists and is not a regular file (mkc replaces only regular files)"


def replaceable(path: str | os.PathLike) -> bool:
    """Whether mkc may write `path`: it does not exist, or it is a regular file. Renaming over a
    device, FIFO or directory would replace it (as root, even /dev/null)."""
    return not Path(path).exists() or Path(path).is_file()


def write_atomically(path: Path, content: str | bytes) -> None:
    """Write via a temp file and rename, so a failed run never leaves a partial file; a path
    that is not `replaceable` is an OSError the CLI reports."""
    path = Path(path)
    if not replaceable(path):
        raise OSError(errno.EEXIST, NOT_REPLACEABLE, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; a generated module gets the usual mode (0644 under the
        # common umask), like any file the user writes.
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

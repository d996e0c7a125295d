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
    from mkc.resolve import ResolveState

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
    from mkc.resolve import name_smallest_slice, resolve
    schedule_ir = resolve(sched, model)
    from mkc.checks import run_checks
    try:
        events = run_checks(schedule_ir)
    except MkcError as e:
        # HBM is the one capacity a bigger slice of the same generation fixes: name the
        # smallest that would do.
        name_smallest_slice(e, sched, model)
        raise
    return Compiled(schedule_ir, text, events=events)


def resolve_spec(spec: str | Path, model: str | None = None, *, after: str | None = None
                 ) -> ResolveState:
    """Parse and resolve, stopping after resolve pass `after` (`mkc ir --after PASS`)."""
    from mkc.lang.parser import parse_file
    sched, _ = parse_file(spec)
    from mkc.resolve import resolve_state
    return resolve_state(sched, model, after=after)


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

"""Writing mkc's outputs (modules, specs, traces, pictures, measures) atomically: a failed run
never leaves a partial file, and only regular files are replaced; and importing a generated
module. Holds no compiler stage, so a writer imports nothing of the pipeline."""
from __future__ import annotations

import errno
import importlib.util
import os
import stat
import sys
import tempfile
import types
from pathlib import Path
from typing import Any


NOT_REPLACEABLE = ("is not a regular file mkc may write (mkc replaces only regular files; a path "
                   "through a file names none)")


def replaceable(path: str | os.PathLike) -> bool:
    """Whether mkc may write `path`, as the OS looks it up: a regular file, or nothing yet (the
    write makes the directories on the way). Renaming over a device, FIFO or directory would
    replace it (as root, even /dev/null); a path through a file (`spec.sched/../x`, ENOTDIR)
    names no file, though `written_path` would make one of it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return True
    except (OSError, ValueError):        # ENOTDIR, ELOOP, a name too long, a NUL byte
        return False


def written_path(path: str | os.PathLike) -> Path:
    """The file `write_atomically(path)` replaces: `path` with its symlinks followed (and `..`
    taken lexically after them: `missing/../x` is `x`). What a command that must not write
    over its input compares."""
    return Path(os.path.realpath(path))


def write_atomically(path: Path, content: str | bytes) -> None:
    """Write via a temp file and rename, so a failed run never leaves a partial file; a path
    that is not `replaceable` is an OSError the CLI reports. What is replaced is the file's
    content, not the file: a symlink's target is written (the link stays) and an existing file
    keeps its mode (a read-only spec stays read-only)."""
    # both the path as given (`f/..` is no path) and the file it leads to (`missing/../fifo`)
    if not replaceable(path):
        raise OSError(errno.EEXIST, NOT_REPLACEABLE, str(path))
    path = written_path(path)
    if not replaceable(path):
        raise OSError(errno.EEXIST, NOT_REPLACEABLE, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        # A new file gets the usual mode (0644 under the common umask), like any file the user
        # writes, not mkstemp's 0600.
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:         # named by the file asked for, not the temp file's name
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
        os.replace(tmp, path)
    except OSError as e:
        os.unlink(tmp)
        raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        os.unlink(tmp)
        raise


_PROCESS_FOLDERS: list[tempfile.TemporaryDirectory] = []


def process_folder(prefix: str) -> Path:
    """A new temporary folder that lasts as long as this process and is removed at its exit
    (a module written there keeps its source for tracebacks while the process runs)."""
    _PROCESS_FOLDERS.append(tempfile.TemporaryDirectory(prefix=prefix))
    return Path(_PROCESS_FOLDERS[-1].name)


def import_generated(path: str | os.PathLike | None = None, *, source: str | None = None,
                     name: str | None = None, register: bool = False,
                     namespace: dict[str, Any] | None = None) -> types.ModuleType:
    """Import a generated module: the file at `path`, or its text `source` (written to a private
    temporary directory first, so tracebacks show its lines), as `name` (default: the file's
    stem). `namespace`: names set in the module before it runs (a test's stand-ins);
    `register`: kept in sys.modules under `name`, for what looks the module up by name (its
    dataclasses, pickling), and dropped again if it fails to import."""
    if (path is None) == (source is None):
        raise ValueError("import_generated takes a path or a source, not both")
    if source is not None:
        if name is None:
            raise ValueError("import_generated of a source needs its name")
        path = process_folder("mkc-module-") / f"{name}.py"
        path.write_text(source)
    name = name or Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    vars(module).update(namespace or {})
    if register:
        sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if register:
            sys.modules.pop(name, None)
        raise
    return module

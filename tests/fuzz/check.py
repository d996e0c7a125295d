"""The `check` target: `mkc check` on a mutant (and, for a sample, `mkc compile` with the
module written and imported, or the step-time model)."""
from __future__ import annotations

import sys
from pathlib import Path

from fuzz.cases import Case, normalized, shown


def _safe_module_name(name: str) -> str | None:
    import keyword
    if not name.isidentifier() or not name.isascii():
        return "module name is not an ASCII identifier"
    if keyword.iskeyword(name):
        return "module name is a Python keyword"
    if name.startswith("__") and name.endswith("__"):
        return "module name is a dunder name"
    if name in sys.stdlib_module_names or name in {"jax", "numpy", "mkc", "lark", "jinja2"}:
        return "module name shadows a standard or installed module"
    return None


def run(case: Case, d: Path, res: dict) -> dict:
    """`mkc check` (and, for a sample, `mkc compile` and an import, or the step-time model)."""
    from mkc import compiler
    spec = case.materialize(d)
    c = compiler.check_spec(spec, case.model)
    if case.compile:
        res["stage"] = "compile"
        c = compiler.compile_spec(spec, case.model)
        res["stage"] = "write"
        return _write_and_import(case, c, d)
    if case.perf:
        res["stage"] = "perf"
        _model_steps(c.ir)
    return {"cls": "ok"}


def _model_steps(s) -> None:
    """`mkc perf` on an accepted spec: its smallest and largest batch, and its verify step."""
    from mkc import perf
    perf.run(s, s.batch_min, min(s.context, 64))
    perf.run(s, s.batch_max)
    if s.verify_rows:
        perf.run(s, None, None, s.verify_rows)


def _write_and_import(case: Case, c, d: Path) -> dict:
    """Write the module as `mkc compile -o out` does (into a package) and import it."""
    import traceback

    from mkc import compiler, files
    name = compiler.module_name(c)
    out = d / "out"
    out.mkdir()
    (out / "__init__.py").write_text("# package marker\n")
    path = out / f"{name}.py"
    existed = path.exists()
    files.write_atomically(path, c.module_source)
    if existed:
        return {"cls": "bad_output", "sig": f"writes over an existing file ({path.name})",
                "detail": f"module name {name!r}"}
    why = _safe_module_name(name)
    if why:
        return {"cls": "bad_output", "sig": why,
                "detail": f"module name {shown(name, 80)}"}
    try:
        files.import_generated(path, name=f"_mkc_fuzz_{case.index}")
    except BaseException as e:          # noqa: BLE001
        frames = traceback.extract_tb(e.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames)
                      if f.filename == str(path)), "?")
        return {"cls": "bad_output", "sig": f"import: {type(e).__name__}: {normalized(str(e))}",
                "detail": f"{type(e).__name__}: {str(e)[:300]} at {where}"}
    finally:
        sys.modules.pop(f"_mkc_fuzz_{case.index}", None)
    return {"cls": "ok", "compiled": True}


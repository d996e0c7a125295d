"""The registry of model families: every subpackage of `mkc.families` that defines `FAMILY`, an
`mkc.model.family.Family` (a package without one is skipped), and any installed package that
declares an `mkc.families` entry point.

Adding a family is adding a package; nothing outside it names the family. The family packages
are found and imported by name, so nothing in `mkc.model` imports them (the import arrows point
from the families to the model interface, never back).
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil

from mkc.model.family import Family

PACKAGE = "mkc.families"          # where shipped families live; also the entry-point group


@functools.cache
def _registry() -> dict[str, Family]:
    shipped = importlib.import_module(PACKAGE)
    modules = [importlib.import_module(f"{PACKAGE}.{m.name}")
               for m in sorted(pkgutil.iter_modules(shipped.__path__), key=lambda m: m.name) if m.ispkg]
    modules += [ep.load() for ep in importlib.metadata.entry_points(group=PACKAGE)]
    return {m.FAMILY.name: m.FAMILY for m in modules if hasattr(m, "FAMILY")}


def get(name: str) -> Family:
    """The family of a dims' or IR's `family` name."""
    return _registry()[name]


def for_model_type(model_type: object) -> Family | None:
    return next((f for f in _registry().values() if model_type in f.model_types), None)


def model_types() -> list[str]:
    """Every config `model_type` some family reads."""
    return sorted(t for f in _registry().values() for t in f.model_types)


def all_families() -> list[Family]:
    """Every registered family, by name."""
    return [f for _, f in sorted(_registry().items())]

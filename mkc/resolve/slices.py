"""The smallest-slice search, in one place: the smallest slice of a spec's generation on which
it resolves and fits HBM, named in the hints of diagnostics a bigger slice fixes (HBM over
capacity, from the checks; shard rules the mesh does not divide, from the graph pass)."""
from __future__ import annotations

import dataclasses

from mkc import target
from mkc.diagnostics import MkcError
from mkc.lang import ast
from mkc.resolve.driver import run
from mkc.resolve.graph import IndivisibleShards


def smallest_topology(sched: ast.Schedule, model_override: str | None = None) -> str | None:
    """The smallest standard slice of the spec's generation on which the spec, with its mesh
    over every rank, resolves (its shard rules divide) and its HBM per chip fits; None if no
    slice up to the pod does. A resolve costs milliseconds, so this is cheap on the failure
    paths that call it."""
    tgt, mesh = sched.settings.get("target"), sched.settings.get("mesh")
    if tgt is None or mesh is None or tgt.value[0].text not in target.known_chips():
        return None
    gen = tgt.value[0].text
    for shape in target.standard_shapes(gen):
        dims = tuple(int(d) for d in shape.split("x"))
        ranks = target.topology(gen, dims).num_cores
        settings = dict(sched.settings)
        settings["target"] = ast.Setting((tgt.value[0], (ast.Name(shape, tgt.span), dims)),
                                         tgt.span)
        settings["mesh"] = ast.Setting((mesh.value[0], ranks), mesh.span)
        try:
            s = run(dataclasses.replace(sched, settings=settings), model_override).schedule_ir
        except MkcError:
            continue
        if s.fits_hbm:
            return f"{gen} topology {shape} (mesh {mesh.value[0].text} = {ranks})"
    return None


def name_smallest_slice(error: MkcError, sched: ast.Schedule,
                        model_override: str | None = None) -> None:
    """Append the smallest slice that works (or that none does) to the hints of the error's
    diagnostics that a bigger slice fixes; others are left as they are."""
    fixable = (error.diagnostics if isinstance(error, IndivisibleShards) else
               [d for d in error.diagnostics if d.code == "E-HBM-CAPACITY"])
    if not fixable:
        return
    found = smallest_topology(sched, model_override)
    for d in fixable:
        d.hint += (f"; the smallest slice that works: `{found}`" if found else
                   "; no slice of this generation fits the spec as written")

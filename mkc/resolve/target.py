"""Pass `target`: the TPU slice (`target GEN topology GRID`) and the mesh over its ranks."""
from __future__ import annotations

import math
from dataclasses import replace

from mkc import target
from mkc.diagnostics import did_you_mean, fail
from mkc.lang import ast
from mkc.resolve.names import require, validate_identifier
from mkc.resolve.state import ResolveState


def resolve_target(s: ResolveState) -> ResolveState:
    topo = _topology(require(s.sched, "target", "target tpu7x topology 2x2x1"))
    mesh = require(s.sched, "mesh", "mesh tp = 8")
    axis_name, ranks = mesh.value
    axis = validate_identifier(axis_name, "mesh axis")
    if ranks != topo.num_cores:
        raise fail("E-MESH", f"mesh {axis} = {ranks} does not match the {topo.num_cores} "
                   f"TensorCores of {topo.chip.name} {topo.shape}", mesh.span,
                   hint=f"use `mesh {axis} = {topo.num_cores}`" + _slices_of(topo.chip, ranks))
    return replace(s, topology=topo, mesh_axis=axis)


def _slices_of(chip: target.Chip, ranks: int) -> str:
    """The rest of the mesh hint: the generation's slices that hold `ranks` ranks, or that none
    does (and the rank counts its slices have)."""
    if fits := target.shapes_of_ranks(chip.name, ranks):
        return f", or a {chip.name} slice of {ranks}: " + " or ".join(
            f"`target {chip.name} topology {shape}`" for shape in fits)
    counts = [chip.cores_per_chip * math.prod(int(d) for d in shape.split("x"))
              for shape in target.standard_shapes(chip.name)]
    return (f"; no {chip.name} slice has {ranks} TensorCores ({chip.cores_per_chip} a chip): its "
            f"slices have {', '.join(map(str, counts))}")


def _topology(tgt: ast.Setting) -> target.Topology:
    """A generation JAX and libtpu know, and a grid libtpu lays out; anything else is a
    diagnostic at the statement, listing what would do."""
    gen, (grid, dims) = tgt.value
    if gen.text in target.all_generations() and gen.text not in target.known_chips():
        raise fail("E-TARGET", f"unsupported TPU generation '{gen.text}': "
                   f"{target.generation(gen.text).unsupported}", gen.span,
                   hint=f"generations mkc compiles for: {', '.join(target.known_chips())}")
    if gen.text not in target.known_chips():
        raise fail("E-TARGET", f"unknown TPU generation '{gen.text}'", gen.span,
                   hint=did_you_mean(gen.text, target.known_chips())
                   + f"generations mkc compiles for: {', '.join(target.known_chips())}")
    try:
        return target.topology(gen.text, dims)
    except target.TargetError as e:
        raise fail("E-TARGET", e.message, grid.span, hint=e.hint) from None

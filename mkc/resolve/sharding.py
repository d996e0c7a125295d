"""Pass `sharding`: `shard CLASS over GROUP`, every dimension class of the family placed on a
rank group of the mesh."""
from __future__ import annotations

from dataclasses import replace

from mkc import target
from mkc.diagnostics import fail
from mkc.lang import ast
from mkc.model.sharding import ShardTable
from mkc.resolve.names import unknown
from mkc.resolve.state import ResolveState


def resolve_sharding(s: ResolveState) -> ResolveState:
    family_name, axis, topo = s.dims.family, s.mesh_axis, s.topology
    classes = s.family.shard_classes
    rules: dict[str, tuple[int, int]] = {}
    for rule in s.sched.shards:
        if rule.dim.text not in classes:
            raise unknown(f"dimension class of {family_name}", rule.dim, list(classes))
        if rule.dim.text in rules:
            raise fail("E-DUPLICATE", f"{rule.dim.text} is sharded twice", rule.span,
                       hint="keep one `shard` line per dimension class")
        rules[rule.dim.text] = group(rule.group, axis, topo)
    unsharded = [c for c in classes if c not in rules]
    if unsharded:
        raise fail("E-SHARD", f"{', '.join(unsharded)} must be sharded: the {family_name} "
                   "lowering places every dimension class", s.sched.name.span,
                   hint=f"add `shard {unsharded[0]} over {axis}`")
    return replace(s, shards=ShardTable.of(rules, topo.num_cores))


def group(g: ast.Group, axis: str, topo: target.Topology) -> tuple[int, int]:
    """A rank group as (ways, stride): rank r is in part (r // stride) % ways."""
    n = topo.num_cores
    if g.name is None:
        if g.ways < 1 or n % g.ways:
            raise fail("E-SHARD", f"{g.ways} ways do not divide the {n} ranks", g.span,
                       hint=f"use a divisor of {n}, `{axis}`, `host` or `chip`")
        return (g.ways, 1)
    text = g.name.text
    if text == axis:
        if g.divisor is None:
            return (n, 1)
        if g.divisor < 1 or n % g.divisor:
            raise fail("E-SHARD", f"{axis} / {g.divisor} does not divide the {n} ranks into "
                       "groups", g.span, hint=f"use a divisor of {n}")
        return (n // g.divisor, g.divisor)
    if g.divisor is not None:
        raise fail("E-SHARD", f"only the mesh axis can be divided, not '{text}'", g.span,
                   hint=f"write `{axis} / {g.divisor}`")
    if text == "host":
        return (topo.cores_per_host, 1)
    if text == "chip":
        return (topo.chip.cores_per_chip, 1)
    raise unknown("rank group", g.name, [axis, "host", "chip"])


def group_spellings(axis: str, topo: target.Topology) -> dict[str, tuple[int, int]]:
    """Every way to write a rank group on this mesh, with the (ways, stride) it means."""
    n = topo.num_cores
    divisors = [d for d in range(2, n) if n % d == 0]
    out = {axis: (n, 1)}
    out |= {str(w): (w, 1) for w in reversed(divisors)}
    out |= {f"{axis} / {d}": (n // d, d) for d in divisors}
    out |= {name: (w, 1) for name, w in (("host", topo.cores_per_host),
                                          ("chip", topo.chip.cores_per_chip)) if 1 < w < n}
    return out

"""The layout of a spec on another slice: shard rules the family's graph builds under, and the
collective lines those rules need.

Shard rules are searched as meanings, (ways, stride) rank groups, not spellings: the spec's
own rule carried over to the new mesh (`tp` stays every rank, `tp / 4` groups of 4, `host` and
`chip` the new slice's host and chip, `32` 32 consecutive ranks) is tried first, then every
group of the mesh, widest first. A rule the family refuses (a ShardingError names the class)
is replaced by the first group that moves the failure elsewhere; coupled rules (K3's experts
and expert_mlp must tile the mesh together) are searched in pairs. Collectives follow the
rules: every op leaving partial sums is all-reduced over its reduction group with an
algorithm valid there, every column-split op is gathered over its rule's group (a swap with
the sibling core where that group is the two cores of a chip).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from mkc import target
from mkc.lang import ast
from mkc.model.family import FormatError
from mkc.model.graph import FamilyGraph, LayerKind, ShardingError, build_graph
from mkc.model.sharding import ShardTable
from mkc.resolve.collectives import two_level_stages
from mkc.resolve.state import ResolveState

Group = tuple[int, int]          # (ways, stride): rank r holds part (r // stride) % ways
# Builds tried before the pair search gives up (a K3 build is well under a millisecond).
MAX_BUILDS = 4000


def mesh_groups(n: int) -> list[Group]:
    """Every rank group a shard rule can name on n ranks, widest first: N consecutive ranks
    for each divisor N (n is `tp`, 1 replicates), and `tp / D`, n / D ways of stride D."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    groups = [(d, 1) for d in divisors] + [(n // d, d) for d in divisors if 1 < d < n]
    return sorted(set(groups), key=lambda g: (-g[0], g[1]))


def spelling(g: ast.Group) -> str:
    """A group as the spec wrote it."""
    if g.name is None:
        return str(g.ways)
    return f"{g.name.text} / {g.divisor}" if g.divisor is not None else g.name.text


def carried_over(g: ast.Group, axis: str, topo: target.Topology) -> Group | None:
    """What the spec's group means on the new slice, or None where it names no group there."""
    n = topo.num_cores
    if g.name is None:
        return (g.ways, 1) if g.ways and n % g.ways == 0 else None
    if g.name.text == axis:
        if g.divisor is None:
            return (n, 1)
        return (n // g.divisor, g.divisor) if n % g.divisor == 0 and g.divisor < n else None
    named = {"host": topo.cores_per_host, "chip": topo.chip.cores_per_chip}
    return (named[g.name.text], 1) if g.name.text in named else None


def spell(group: Group, axis: str, topo: target.Topology, written: str | None = None) -> str:
    """How a shard line or gather writes `group`: the spec's own spelling where it still means
    the group, else the mesh axis, `host`, `chip`, a count or `tp / D`."""
    n = topo.num_cores
    ways, stride = group
    named = {"host": topo.cores_per_host, "chip": topo.chip.cores_per_chip}
    if written in named and named[written] == ways and stride == 1 and 1 < ways < n:
        return written
    if group == (n, 1):
        return axis
    if stride == 1:
        return str(ways)
    return f"{axis} / {stride}"


@dataclass
class Builder:
    """The family's graph under candidate rules on the new mesh (the state after resolve's
    `formats` pass on the new slice supplies dims, family and formats)."""

    state: ResolveState
    builds: int = 0

    @property
    def ranks(self) -> int:
        return self.state.topology.num_cores

    def graph(self, rules: dict[str, Group]) -> FamilyGraph | ShardingError:
        """The graph, or the ShardingError saying which class's rule does not fit; partial sums
        must reduce over one rank group."""
        self.builds += 1
        st = self.state
        try:
            g = build_graph(st.dims, st.family.build(st.dims, rules, self.ranks, st.formats),
                            self.ranks)
            table = ShardTable.of(rules, self.ranks)
            for kind in g.kinds.values():
                for classes in partial_classes(kind).values():
                    table.reduction_group(classes)
            return g
        except ShardingError as e:
            return e
        except FormatError as e:
            return ShardingError(str(e), None)


def partial_classes(kind: LayerKind) -> dict[str, tuple[str, ...]]:
    """op -> the classes its partial sums are split over, for the ops that leave partial sums."""
    out = {o.name: o.partial or (kind.tensors[o.matmul].partial_out if o.matmul else ())
           for o in kind.ops}
    return {k: v for k, v in out.items() if v}


def split_classes(kind: LayerKind) -> dict[str, str]:
    """op -> the class its column-split product is split by."""
    return {o.name: kind.tensors[o.matmul].split_out for o in kind.ops
            if o.matmul and kind.tensors[o.matmul].split_out}


def search_rules(builder: Builder, start: dict[str, Group],
                 options: dict[str, list[Group]]) -> dict[str, Group] | ShardingError:
    """Rules the family builds under, from `start`, changing the refused class's rule to its
    first option that builds or moves the refusal to another class; a pair of classes
    together when no single change does. The last refusal if nothing builds."""
    rules, seen = dict(start), set()
    err: ShardingError | None = None
    while builder.builds < MAX_BUILDS:
        found = builder.graph(rules)
        if not isinstance(found, ShardingError):
            return rules
        err = found
        key = tuple(sorted(rules.items()))
        if key in seen:
            break
        seen.add(key)
        blamed = [err.dim_class] if err.dim_class in rules else list(rules)
        step = _single_change(builder, rules, blamed, options) or \
            _pair_change(builder, rules, blamed, options)
        if step is None:
            break
        rules = step
    return err or ShardingError("no shard rules build", None)


def _single_change(builder: Builder, rules: dict[str, Group], blamed: list[str],
                   options: dict[str, list[Group]]) -> dict[str, Group] | None:
    """The first one-class change that builds, else the first that moves the refusal."""
    moved = None
    for cls in blamed:
        for g in options[cls]:
            if g == rules[cls]:
                continue
            cand = rules | {cls: g}
            found = builder.graph(cand)
            if not isinstance(found, ShardingError):
                return cand
            if moved is None and found.dim_class not in (cls, None):
                moved = cand
    return moved


def _pair_change(builder: Builder, rules: dict[str, Group], blamed: list[str],
                 options: dict[str, list[Group]]) -> dict[str, Group] | None:
    """The first two-class change that builds or moves the refusal to a third class."""
    for cls in blamed:
        for other in (c for c in rules if c != cls):
            for g, h in product(options[cls], options[other]):
                if builder.builds >= MAX_BUILDS:
                    return None
                cand = rules | {cls: g, other: h}
                if cand == rules:
                    continue
                found = builder.graph(cand)
                if not isinstance(found, ShardingError) or found.dim_class not in (cls, other, None):
                    return cand
    return None


def valid_algorithms(groups: list[Group], topo: target.Topology) -> list[str]:
    """The all-reduce algorithms valid for every one of the rank groups a line reduces over."""
    levels = {"chip": topo.chip.cores_per_chip, "host": topo.cores_per_host}
    out = ["direct"]
    for level, cores in levels.items():
        if cores > 1 and all(two_level_stages(size, stride, cores) for size, stride in groups):
            out.append(f"two_level {level}")
    return out


def choose_algorithm(written: str, groups: list[Group], topo: target.Topology,
                     by_span: bool) -> str:
    """The spec's algorithm where it is valid (unless `by_span`); otherwise two levels over
    hosts for a group that spans hosts (one cross-host message per host instead of one per
    rank, and a receive buffer of hosts rather than ranks), else the spec's level if valid,
    else direct."""
    valid = valid_algorithms(groups, topo)
    if written in valid and not by_span:
        return written
    spans_hosts = any(size * stride > topo.cores_per_host for size, stride in groups)
    if spans_hosts and "two_level host" in valid:
        return "two_level host"
    return written if written in valid else "direct"

"""Which shard of each dimension class a rank holds, read by the graph, the collectives, the
weight packing and the reference alike.

A spec's `shard CLASS over GROUP` resolves to (ways, stride): rank r holds part
(r // stride) % ways of the class. A class of fewer ways than ranks is replicated: the ranks
r, r + ways * stride, ... hold the same part. A product whose contraction is split over a
class is a partial sum over the ranks holding its different parts, the group
(ways, stride) containing the rank; replicas of that group compute the same sums.
"""
from __future__ import annotations

from dataclasses import dataclass

from mkc.model.graph import ShardingError


@dataclass(frozen=True)
class ShardTable:
    """The resolved shard rules of one schedule: class -> (ways, stride) over `ranks` ranks."""

    ranks: int
    rules: tuple[tuple[str, int, int], ...]    # (class, ways, stride), in a stable order

    @staticmethod
    def of(rules: dict[str, tuple[int, int]], ranks: int) -> "ShardTable":
        return ShardTable(ranks, tuple((c, w, s) for c, (w, s) in sorted(rules.items())))

    def rule(self, cls: str) -> tuple[int, int]:
        for c, ways, stride in self.rules:
            if c == cls:
                return ways, stride
        raise KeyError(f"no shard rule for dimension class {cls!r}")

    def ways(self, cls: str) -> int:
        return self.rule(cls)[0]

    def part(self, cls: str, rank: int) -> int:
        """The part of `cls` that rank `rank` holds."""
        ways, stride = self.rule(cls)
        return (rank // stride) % ways

    def holders(self, cls: str) -> tuple[int, ...]:
        """One rank per part of `cls`, in part order: the lowest rank holding each."""
        ways, stride = self.rule(cls)
        return tuple(p * stride for p in range(ways))

    def replicas(self, cls: str) -> int:
        return self.ranks // self.ways(cls)

    def reduction_group(self, classes: tuple[str, ...]) -> tuple[int, int]:
        """The rank group (size, stride) over which a product split over `classes` is a
        partial sum: the ranks holding every combination of their parts. The classes' groups
        must nest into one (`experts over tp / 4` with `expert_mlp over 4` spans the mesh)."""
        if not classes:
            return (self.ranks, 1)
        groups = sorted((stride, ways, c) for c in classes for ways, stride in [self.rule(c)])
        stride, size, first = groups[0]
        for s, w, c in groups[1:]:
            if s != size * stride:
                raise ShardingError(f"the partial sums split over {first} and {c} do not form "
                                    f"one rank group ({size} ranks of stride {stride}, then "
                                    f"{w} of stride {s})", c)
            size *= w
        return (size, stride)

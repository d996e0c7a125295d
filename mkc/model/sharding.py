"""Which shard of each dimension class a rank holds, read by the graph, the collectives, the
weight packing and the reference alike.

A spec's `shard CLASS over GROUP` resolves to (ways, stride): rank r holds part
(r // stride) % ways of the class. A class of fewer ways than ranks is replicated: the ranks
r, r + ways * stride, ... hold the same part. A product whose contraction is split over a
class is a partial sum over the ranks holding its different parts, the group
(ways, stride) containing the rank; replicas of that group compute the same sums.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mkc.model.graph import ShardingError

if TYPE_CHECKING:
    import jax


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


def rank_parts(a: np.ndarray | jax.Array, ranks: Iterable[int]) -> dict[int, np.ndarray]:
    """``a[r]`` on the host for each rank r of ``ranks``, of an array with a leading rank axis:
    a numpy array, or a ``jax.Array`` sharded along that axis. Of the latter only the shards
    holding those ranks are copied: a state's reference view (``reference_states``) reads a
    few ranks, and ``np.asarray`` of the whole array gathers every rank's copy (a replicated
    cache of a 16-rank MINI model at batch 8: 16 copies of 50 MB, to read one)."""
    wanted = sorted(set(ranks))
    shards = getattr(a, "addressable_shards", None)
    if shards is None:
        a = np.asarray(a)
        return {r: a[r] for r in wanted}
    out: dict[int, np.ndarray] = {}
    for shard in shards:
        first, stop, _ = shard.index[0].indices(a.shape[0]) if shard.index else (0, a.shape[0], 1)
        held = [r for r in wanted if first <= r < stop and r not in out]
        if held:
            data = np.asarray(shard.data)
            out.update({r: data[r - first] for r in held})
    missing = [r for r in wanted if r not in out]
    if missing:     # not on this process's devices: gathered (fails where JAX cannot gather)
        whole = np.asarray(a)
        out.update({r: whole[r] for r in missing})
    return out

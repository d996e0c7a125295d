"""The shard table: which part of each class a rank holds, and the group a partial sum spans."""
import pytest

from mkc.model.graph import ShardingError
from mkc.model.sharding import ShardTable

# 16 ranks: heads over 8 (replicated twice), vocab over all 16, experts in groups of 4
# consecutive ranks (tp / 4) with each expert's width over the 4 ranks of a group.
TABLE = ShardTable.of({"heads": (8, 1), "vocab": (16, 1), "experts": (4, 4),
                       "expert_mlp": (4, 1), "every_other": (8, 2)}, 16)


def test_parts_replicate_across_the_rest_of_the_mesh():
    assert [TABLE.part("heads", r) for r in range(16)] == list(range(8)) * 2
    assert [TABLE.part("experts", r) for r in range(16)] == [r // 4 for r in range(16)]
    assert [TABLE.part("every_other", r) for r in range(16)] == [(r // 2) % 8 for r in range(16)]
    assert TABLE.replicas("heads") == 2 and TABLE.replicas("vocab") == 1


def test_holders_are_the_first_rank_of_each_part():
    assert TABLE.holders("heads") == tuple(range(8))
    assert TABLE.holders("experts") == (0, 4, 8, 12)
    assert TABLE.holders("every_other") == (0, 2, 4, 6, 8, 10, 12, 14)
    for cls in ("heads", "experts", "every_other"):
        assert [TABLE.part(cls, r) for r in TABLE.holders(cls)] == list(range(TABLE.ways(cls)))


def test_reduction_groups():
    assert TABLE.reduction_group(("heads",)) == (8, 1)
    assert TABLE.reduction_group(("every_other",)) == (8, 2)
    # nested groups: the 4 width slices inside each group, then the 4 groups
    assert TABLE.reduction_group(("experts", "expert_mlp")) == (16, 1)
    assert TABLE.reduction_group(()) == (16, 1)


def test_groups_that_do_not_nest_are_refused():
    with pytest.raises(ShardingError, match="do not form one rank group"):
        TABLE.reduction_group(("heads", "expert_mlp"))

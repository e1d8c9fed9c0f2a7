import pytest

from lightning_recsys.parallel import ParallelTopology


def test_all_to_all_optimized_groups_are_contiguous_nodes():
    topo = ParallelTopology(world_size=8, sharding_group_size=4)
    assert topo.sharding_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.replica_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.local_shard_rank(6) == 2
    assert topo.num_replicas == 2 and not topo.is_1d


def test_all_reduce_optimized_groups_are_strided():
    topo = ParallelTopology(world_size=8, sharding_group_size=4, layout="all_reduce_optimized")
    assert topo.sharding_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.replica_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_group_size_equal_to_world_is_1d():
    topo = ParallelTopology(world_size=4, sharding_group_size=4)
    assert topo.is_1d and topo.sharding_groups() == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 6, "sharding_group_size": 4}, r"sharding_group_size=4 must divide the world size \(6\); valid sizes are \[1, 2, 3, 6\]"),
        ({"world_size": 2, "sharding_group_size": 4}, r"sharding_group_size=4 is larger than the world size \(2\)"),
        ({"world_size": 4, "sharding_group_size": 0}, r"sharding_group_size=0 must be >= 1"),
        ({"world_size": 4, "sharding_group_size": 2, "layout": "ring"}, r"layout='ring' is not one of"),
    ],
)
def test_invalid_topology_names_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelTopology(**kwargs)

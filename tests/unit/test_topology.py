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
        ({"world_size": 4, "sharding_group_size": 2, "ranks_per_node": 3}, r"ranks_per_node=3 must be >= 1 and divide the world size \(4\)"),
    ],
)
def test_invalid_topology_names_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelTopology(**kwargs)


def test_node_boundaries_and_planner_local_size():
    contiguous = ParallelTopology(world_size=8, sharding_group_size=4, ranks_per_node=4)
    assert [contiguous.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert not contiguous.spans_nodes(contiguous.sharding_group_of(5))
    assert contiguous.spans_nodes(contiguous.replica_group_of(5))
    assert contiguous.group_ranks_per_node == 4
    strided = ParallelTopology(world_size=8, sharding_group_size=4, layout="all_reduce_optimized", ranks_per_node=4)
    assert strided.spans_nodes(strided.sharding_group_of(0)) and not strided.spans_nodes(strided.replica_group_of(0))
    assert strided.group_ranks_per_node == 2
    assert contiguous.layout_warnings() == [] and strided.layout_warnings() == []


def test_layout_that_defeats_its_purpose_is_reported():
    # Groups of 4 on nodes of 2: the "node-local" all-to-all would cross nodes.
    (warning,) = ParallelTopology(world_size=8, sharding_group_size=4, ranks_per_node=2).layout_warnings()
    assert "puts a sharding group across nodes" in warning


def test_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match=r"needs an initialized default process group"):
        ParallelTopology(world_size=2, sharding_group_size=1).device_mesh("cpu")


def test_the_dense_all_reduce_is_staged_only_for_2d_on_gloo_across_nodes() -> None:
    from lightning_recsys.parallel.comms.dense_all_reduce import uses_staged_all_reduce

    two_nodes_2d = ParallelTopology.for_world(ranks_per_node=2, num_nodes=2, sharding_group_size=2)
    assert uses_staged_all_reduce(two_nodes_2d, "gloo")
    assert not uses_staged_all_reduce(two_nodes_2d, "nccl")  # NCCL picks topology-aware algorithms itself
    assert not uses_staged_all_reduce(ParallelTopology.for_world(ranks_per_node=2, num_nodes=2, sharding_group_size=4), "gloo")  # 1D
    assert not uses_staged_all_reduce(ParallelTopology(world_size=4, sharding_group_size=2), "gloo")  # one node

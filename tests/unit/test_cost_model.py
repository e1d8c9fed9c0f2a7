"""The communication cost model's arithmetic, on examples worked out by hand (no process group)."""

import math

import pytest

from lightning_recsys.planner.cost.cost_model import (
    Cluster,
    Collective,
    GroupGeometry,
    Link,
    Parallelism,
    Workload,
    analytic_traffic,
    collective_cost,
    collectives_from_accounting,
    fit_compute_for_scaling,
    group_geometry,
    network_penalty,
    row_bytes,
    scale_traffic,
    scaling_factor,
    step_time,
    topology_for,
)

MB = 1e6
# The emulated cluster: 2 nodes x 2 ranks, 25 MB/s (200 Mbit/s) and 1 ms one-way between nodes, loopback inside.
EMULATED = Cluster(nodes=2, ranks_per_node=2, intra=Link.free(), inter=Link(bandwidth_bytes_per_s=25 * MB, latency_s=1e-3))


def test_group_geometry_of_both_layouts():
    a2a = topology_for(EMULATED, 2, "all_to_all_optimized")  # groups [0,1] [2,3]: one per node
    assert group_geometry(a2a, "shard") == GroupGeometry(size=2, nodes=1, per_node=2, groups_per_node=1)
    assert group_geometry(a2a, "replicate") == GroupGeometry(size=2, nodes=2, per_node=1, groups_per_node=2)
    assert group_geometry(a2a, "world") == GroupGeometry(size=4, nodes=2, per_node=2, groups_per_node=1)
    ar = topology_for(EMULATED, 2, "all_reduce_optimized")  # groups [0,2] [1,3]: across nodes
    assert group_geometry(ar, "shard") == GroupGeometry(size=2, nodes=2, per_node=1, groups_per_node=2)
    assert group_geometry(ar, "replicate") == GroupGeometry(size=2, nodes=1, per_node=2, groups_per_node=1)
    one_d = topology_for(EMULATED, None)
    assert one_d.is_1d and group_geometry(one_d, "shard") == group_geometry(one_d, "world")


def test_all_to_all_over_two_nodes():
    # 4 MB per rank over 4 ranks: 1 MB to each. Intra: 1 MB to the node's other rank. Inter: each of the
    # node's 2 ranks sends 2 MB to the other node -> 4 MB through the uplink = 0.16 s at 25 MB/s.
    c = Collective(purpose="embeddings", op="all_to_all", group="world", calls=2, payload_bytes=4 * MB)
    cost = collective_cost(c, GroupGeometry(size=4, nodes=2, per_node=2, groups_per_node=1), EMULATED)
    assert cost.intra_bytes == pytest.approx(1 * MB)
    assert cost.inter_bytes == pytest.approx(4 * MB)
    assert cost.bandwidth_s == pytest.approx(0.16)
    assert cost.latency_s == pytest.approx(2 * 2 * 1e-3)  # 2 calls x one round trip
    assert cost.seconds == pytest.approx(0.164)


def test_all_to_all_inside_a_node_costs_only_the_intra_link():
    nvlink = Cluster(nodes=2, ranks_per_node=2, intra=Link(bandwidth_bytes_per_s=100 * MB, latency_s=1e-5), inter=EMULATED.inter)
    c = Collective(purpose="embeddings", op="all_to_all", group="shard", calls=1, payload_bytes=4 * MB)
    cost = collective_cost(c, GroupGeometry(size=2, nodes=1, per_node=2, groups_per_node=1), nvlink)
    assert (cost.intra_bytes, cost.inter_bytes) == (pytest.approx(2 * MB), 0.0)
    assert cost.seconds == pytest.approx(2 * MB / (100 * MB) + 2e-5)


def test_ring_all_reduce_bytes():
    # Replica groups {0,2} and {1,3}: each edge carries 2(2-1)/2 = 1x the payload; both groups cross the
    # same uplink -> 2 MB for 1 MB each; latency 2 ceil(log2 2) = 2 one-way hops.
    sync = Collective(purpose="replica_sync", op="all_reduce", group="replicate", calls=1, payload_bytes=1 * MB)
    cost = collective_cost(sync, GroupGeometry(size=2, nodes=2, per_node=1, groups_per_node=2), EMULATED)
    assert cost.inter_bytes == pytest.approx(2 * MB)
    assert cost.seconds == pytest.approx(2 * MB / (25 * MB) + 2e-3)
    # The world ring 0-1-2-3: 2(4-1)/4 = 1.5x the payload per edge, one edge leaves each node; 4 hops.
    dense = Collective(purpose="dense_grads", op="all_reduce", group="world", calls=1, payload_bytes=1 * MB)
    cost = collective_cost(dense, GroupGeometry(size=4, nodes=2, per_node=2, groups_per_node=1), EMULATED)
    assert (cost.intra_bytes, cost.inter_bytes) == (pytest.approx(1.5 * MB), pytest.approx(1.5 * MB))
    assert cost.latency_s == pytest.approx(4e-3)
    # Reduce-scatter is half an all-reduce of its input; an all-gather's payload is the rank's chunk, of
    # which each ring edge carries n-1 (everyone else's); a single-rank group costs nothing.
    rs = Collective(purpose="embeddings", op="reduce_scatter", group="world", calls=1, payload_bytes=1 * MB)
    assert collective_cost(rs, GroupGeometry(4, 2, 2, 1), EMULATED).inter_bytes == pytest.approx(0.75 * MB)
    ag = Collective(purpose="replica_sync", op="all_gather", group="world", calls=1, payload_bytes=1 * MB)
    assert collective_cost(ag, GroupGeometry(4, 2, 2, 1), EMULATED).inter_bytes == pytest.approx(3 * MB)
    assert collective_cost(dense, GroupGeometry(1, 1, 1, 2), EMULATED).seconds == 0.0


def test_step_time_and_network_penalty_by_hand():
    topology = topology_for(EMULATED, None)
    collectives = [
        Collective(purpose="embeddings", op="all_to_all", group="world", calls=2, payload_bytes=4 * MB),  # 0.164 s
        Collective(purpose="dense_grads", op="all_reduce", group="world", calls=1, payload_bytes=1 * MB),  # 0.06 + 0.004 s
    ]
    estimate = step_time(collectives, topology, EMULATED, compute_s=0.1)
    assert estimate.step_s == pytest.approx(0.1 + 0.164 + 0.064)
    assert estimate.inter_node_bytes == pytest.approx(5.5 * MB)
    assert estimate.seconds_by_purpose() == {"embeddings": pytest.approx(0.164), "dense_grads": pytest.approx(0.064)}
    assert network_penalty(collectives, topology, EMULATED, 0.1) == pytest.approx(3.28)
    # Overlapped purposes count only beyond the compute time.
    assert step_time(collectives, topology, EMULATED, 0.1, overlapped=["dense_grads"]).step_s == pytest.approx(0.264)
    assert step_time(collectives, topology, EMULATED, 0.05, overlapped=["dense_grads"]).step_s == pytest.approx(0.05 + 0.164 + 0.014)


def test_scaling_and_the_fitted_compute_time():
    assert scaling_factor(0.010, 0.020, 4) == pytest.approx(2.0)
    # 4 (C + 1) / (C + 10) = 2  ->  C = 8
    assert fit_compute_for_scaling(1.0, 10.0, 4, 2.0) == pytest.approx(8.0)
    assert scaling_factor(8.0 + 1.0, 8.0 + 10.0, 4) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no compute time"):
        fit_compute_for_scaling(1.0, 1.0, 4, 3.0)  # comm alone scales 4x: 3x needs negative compute
    with pytest.raises(ValueError, match="target_scaling"):
        fit_compute_for_scaling(1.0, 2.0, 4, 4.0)


def test_row_bytes_per_precision():
    assert row_bytes(64, "fp32") == 256
    assert row_bytes(64, "bf16") == row_bytes(64, "fp16") == 128
    assert row_bytes(64, "fp8") == row_bytes(64, "int8") == 68  # one fp32 scale per row
    with pytest.raises(ValueError, match="precision"):
        row_bytes(64, "fp4")


BENCH = Workload(batch_per_rank=1024, num_tables=8, embedding_dim=64, rows_per_table=512, pooling_factor=2.0, dense_param_bytes=54532)


def _by_purpose(collectives):
    return {c.purpose: c for c in collectives}


def test_analytic_traffic_matches_the_benchmark_accounting():
    # The bytes emulated_cluster.py measured with strategy.comm_accounting (rank 0, per step).
    one_d = _by_purpose(analytic_traffic(BENCH, Parallelism(), topology_for(EMULATED, None)))
    assert one_d["embeddings"].payload_bytes == 8 * 1024 * 64 * 4 * 2 == 4194304
    assert one_d["sparse_ids"].payload_bytes == 8 * 1024 * (2 * 8 + 8) == 196608
    assert one_d["dense_grads"].payload_bytes == 54532
    assert "replica_sync" not in one_d
    par = Parallelism(sharding_group_size=2, forward="fp8", backward="bf16", sync_every_n_steps=4)
    two_d = _by_purpose(analytic_traffic(BENCH, par, topology_for(EMULATED, 2)))
    assert two_d["embeddings"].payload_bytes == 8 * 1024 * (68 + 128) == 1605632
    assert two_d["replica_sync"].payload_bytes == 8 * 512 * 64 * 4 / 2 / 4 == 131072
    assert two_d["replica_sync"].calls == 0.25


def test_scale_traffic_follows_batch_dim_tables_and_layout():
    measured = [
        Collective(purpose="embeddings", op="all_to_all", group="world", calls=2, payload_bytes=4194304),
        Collective(purpose="sparse_ids", op="all_to_all", group="world", calls=3, payload_bytes=197416),  # +808 metadata
        Collective(purpose="dense_grads", op="all_reduce", group="world", calls=1, payload_bytes=54532),
        Collective(purpose="metrics", op="all_reduce", group="world", calls=1, payload_bytes=8),
    ]
    source = {"measured_workload": BENCH, "measured_parallelism": Parallelism(), "measured_topology": topology_for(EMULATED, None)}
    bigger = Workload(
        batch_per_rank=2048, num_tables=16, embedding_dim=128, rows_per_table=512, pooling_factor=2.0, dense_param_bytes=54532
    )
    scaled = _by_purpose(
        scale_traffic(measured, **source, workload=bigger, parallelism=Parallelism(), topology=topology_for(EMULATED, None))
    )
    assert scaled["embeddings"].payload_bytes == pytest.approx(4194304 * 2 * 2 * 2)  # batch x tables x dim
    assert scaled["sparse_ids"].payload_bytes == pytest.approx(197416 * 2 * 2)  # metadata scales along
    assert scaled["dense_grads"].payload_bytes == pytest.approx(54532)
    assert scaled["metrics"].payload_bytes == 8  # unknown purposes are kept as measured
    # 1D profile -> 2D all-to-all optimized with FP8/BF16: the embedding all-to-all moves to the sharding
    # group and shrinks to (68 + 128) / 512; a replica sync of the rank's shard appears.
    two_d = Parallelism(sharding_group_size=2, forward="fp8", backward="bf16")
    scaled = _by_purpose(scale_traffic(measured, **source, workload=BENCH, parallelism=two_d, topology=topology_for(EMULATED, 2)))
    assert scaled["embeddings"].group == "shard"
    assert scaled["embeddings"].payload_bytes == pytest.approx(4194304 * 196 / 512)
    assert scaled["replica_sync"].payload_bytes == pytest.approx(8 * 512 * 64 * 4 / 2)


def test_8_gpu_nodes_projection_by_hand():
    # 4 nodes x 8 GPUs, 1D: an all-to-all of P per GPU sends 24/32 of it off the node from all 8 GPUs.
    cluster = Cluster(nodes=4, ranks_per_node=8, intra=Link(bandwidth_bytes_per_s=300e9), inter=Link.gbit(400))
    topology = topology_for(cluster, None)
    a2a = Collective(purpose="embeddings", op="all_to_all", group="shard", calls=1, payload_bytes=100 * MB)
    estimate = step_time([a2a], topology, cluster, compute_s=0.0)
    assert estimate.inter_node_bytes == pytest.approx(8 * 100 * MB * 24 / 32)
    assert estimate.step_s == pytest.approx(600 * MB / 50e9)  # 400 Gb/s = 50 GB/s; NVLink part (7/32 x 100 MB / 300 GB/s) is faster
    # 2D all-to-all optimized: the same all-to-all stays on NVLink.
    two_d = topology_for(cluster, 8)
    assert step_time([a2a], two_d, cluster, 0.0).step_s == pytest.approx(100 * MB * 7 / 8 / 300e9)


def test_inputs_are_validated():
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        Link(bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="op="):
        Collective(purpose="x", op="gather", group="world", calls=1, payload_bytes=1)
    with pytest.raises(ValueError, match="is on group 'ranks0,2'"):
        collectives_from_accounting([{"purpose": "x", "op": "all_reduce", "group": "ranks0,2", "calls": 1, "payload_bytes": 1}])
    with pytest.raises(ValueError, match="does not match the cluster"):
        step_time([], topology_for(EMULATED, None), Cluster(nodes=1, ranks_per_node=4, intra=Link.free(), inter=Link.free()), 0.0)
    with pytest.raises(ValueError, match="layout="):
        Parallelism(layout="ring")
    assert math.isinf(Link.free().bandwidth_bytes_per_s)


def test_a_token_bucket_lets_the_start_of_each_call_through():
    shaped = Cluster(nodes=2, ranks_per_node=2, intra=Link.free(), inter=Link(bandwidth_bytes_per_s=25 * MB, burst_bytes=0.5 * MB))
    c = Collective(purpose="embeddings", op="all_to_all", group="world", calls=2, payload_bytes=4 * MB)
    # 4 MB leave the node in 2 calls; each call's first 0.5 MB passes at once: (4 - 2 x 0.5) MB / 25 MB/s.
    assert collective_cost(c, GroupGeometry(4, 2, 2, 1), shaped).bandwidth_s == pytest.approx(0.12)
    small = Collective(purpose="sparse_ids", op="all_to_all", group="world", calls=3, payload_bytes=0.3 * MB)
    assert collective_cost(small, GroupGeometry(4, 2, 2, 1), shaped).bandwidth_s == 0.0

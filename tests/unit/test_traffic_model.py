"""Touched-row traffic (Zipf union), sequence features and the layout advice, against Monte-Carlo and hand arithmetic."""

import pytest
import torch

from lightning_recsys.parallel.sync.replica_sync_config import ReplicaSyncConfig
from lightning_recsys.planner.cost.cost_model import Cluster, Link, topology_for
from lightning_recsys.planner.cost.layout_advice import Hardware, TableProfile, parse_cluster, recommend, shape_from_tables
from lightning_recsys.planner.cost.traffic_model import (
    Feature,
    ModelShape,
    StrategyChoice,
    expected_distinct,
    hot_row_share,
    overlapped_purposes,
    workload_traffic,
    zipf_exponent_for_distinct,
    zipf_exponent_for_hot_share,
)

EMULATED = Cluster(nodes=2, ranks_per_node=2, intra=Link.free(), inter=Link(bandwidth_bytes_per_s=25e6, latency_s=1e-3))


def _monte_carlo_distinct(rows: int, draws: int, exponent: float, samples: int = 8) -> float:
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** exponent
    cdf = torch.cumsum(weights / weights.sum(), 0)
    gen = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(samples):
        ids = torch.searchsorted(cdf, torch.rand(draws, generator=gen, dtype=torch.float64)).clamp_(max=rows - 1)
        counts.append(ids.unique().numel())
    return sum(counts) / samples


@pytest.mark.parametrize("exponent", [0.0, 0.8, 1.05, 1.3])
@pytest.mark.parametrize("rows,draws", [(50_000, 3_000), (200_000, 100_000)])
def test_expected_distinct_matches_monte_carlo_and_the_exact_sum(rows, draws, exponent):
    # The head (4096 rows) is summed exactly, the tail integrated: both parts are exercised at these sizes.
    estimate = expected_distinct(rows, draws, exponent)
    p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** exponent
    p /= p.sum()
    assert estimate == pytest.approx(float((1 - (1 - p) ** draws).sum()), rel=1e-4)
    assert estimate == pytest.approx(_monte_carlo_distinct(rows, draws, exponent), rel=0.04)  # 8 samples: a few % of noise


def test_expected_distinct_limits():
    assert expected_distinct(1000, 0, 1.05) == 0.0
    assert expected_distinct(1000, 1e9, 1.05) == pytest.approx(1000, rel=1e-6)  # every row touched
    assert expected_distinct(10**8, 10, 0.5) == pytest.approx(10, rel=1e-3)  # a mild skew over many rows: every draw new
    assert expected_distinct(10**8, 10, 1.05) < 10  # Zipf 1.05 has a hot head (p_1 ~ 5%): some draws repeat
    assert expected_distinct(10**6, 5000, 0.0) == pytest.approx(10**6 * (1 - (1 - 1e-6) ** 5000), rel=1e-4)  # uniform
    assert expected_distinct(10**6, 5000, 1.3) < expected_distinct(10**6, 5000, 0.8)  # hotter ids, smaller union
    with pytest.raises(ValueError, match="draws"):
        expected_distinct(10, -1, 1.0)
    with pytest.raises(ValueError, match="zipf exponent"):
        expected_distinct(10, 1, -0.5)


@pytest.mark.parametrize("exponent", [0.0, 0.8, 1.05, 1.3])
def test_zipf_exponent_fitted_to_a_small_samples_distinct_rows(exponent):
    # A profile's sample: fewer lookups than the hottest 1% of rows, as a few batches over a big table give.
    rows, draws = 10**5, 2048
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** exponent
    gen = torch.Generator().manual_seed(1)
    ids = torch.multinomial(weights, draws, replacement=True, generator=gen)
    fitted = zipf_exponent_for_distinct(rows, draws, ids.unique().numel())
    assert fitted == pytest.approx(exponent, abs=0.05)
    # The sample's hot-row share overstates the skew: its top 1000 rows hold most of 2048 lookups whatever the skew.
    counts = torch.bincount(ids, minlength=rows).double()
    sampled_share = float(counts.topk(rows // 100).values.sum() / counts.sum())
    assert zipf_exponent_for_hot_share(rows, min(sampled_share, 0.999999)) > exponent + 0.2 > fitted + 0.15
    with pytest.raises(ValueError, match="distinct"):
        zipf_exponent_for_distinct(rows, draws, draws + 1)


def test_advice_fits_skew_to_the_profile_sample_before_the_hot_share():
    sampled = TableProfile("a", 10**5, 16, 2.0, 0.99, True, (2048, int(expected_distinct(10**5, 2048, 1.05))))
    shape, assumed = shape_from_tables("p", [sampled], batch_per_rank=64, dense_param_bytes=10)
    assert shape.features[0].zipf_exponent == pytest.approx(1.05, abs=0.01)
    assert any("fitted to the distinct rows" in a for a in assumed)


def test_zipf_exponent_from_a_hot_row_share_round_trips():
    share = hot_row_share(10**6, 1.1)
    assert zipf_exponent_for_hot_share(10**6, share) == pytest.approx(1.1, abs=1e-6)
    assert hot_row_share(1000, 0.0) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="hot_row_share"):
        zipf_exponent_for_hot_share(1000, 0.001)  # less than uniform


def _by_purpose(collectives):
    out = {}
    for c in collectives:
        out[(c.purpose, c.op)] = c
    return out


def test_pooled_and_sequence_all_to_all_bytes_by_hand():
    pooled = Feature(name="p", rows=1000, dim=16, ids_per_example=4)
    seq = Feature(name="s", rows=1000, dim=16, ids_per_example=4, pooled=False)
    one_d = topology_for(EMULATED, None)
    for feature, vectors in ((pooled, 1), (seq, 4)):
        shape = ModelShape(name="x", batch_per_rank=10, features=(feature,), dense_param_bytes=100)
        t = _by_purpose(workload_traffic(shape, StrategyChoice(), one_d))
        assert t[("embeddings", "all_to_all")].payload_bytes == 10 * vectors * 16 * 4 * 2  # forward + backward, fp32
        assert t[("sparse_ids", "all_to_all")].payload_bytes == 10 * (4 * 8 + 8)
        assert t[("dense_grads", "all_reduce")].payload_bytes == 100
        assert ("replica_sync", "all_reduce") not in t


def test_touched_sync_bytes_by_hand():
    # A stated touched fraction of 10% of 1000 rows per sync, dim 16 + 1 Adagrad float, over group 2, every 4 steps.
    f = Feature(name="t", tables=2, rows=1000, dim=16, ids_per_example=1, touched_fraction=0.1)
    shape = ModelShape(name="x", batch_per_rank=8, features=(f,), dense_param_bytes=0, optimizer_state_per_row=1)
    two_d = topology_for(EMULATED, 2)
    sync = ReplicaSyncConfig(rows="touched", every_n_steps=4)
    t = _by_purpose(workload_traffic(shape, StrategyChoice(sharding_group_size=2, sync=sync), two_d))
    rows_per_rank = 2 * 100 / 2
    assert t[("replica_sync", "all_reduce")].payload_bytes == pytest.approx((rows_per_rank * 17 * 4 + 8) / 4)
    assert t[("replica_sync", "all_reduce")].calls == pytest.approx(0.5)  # the count and the rows, every 4 steps
    # The union agreement: 100 ids x 4 bytes per rank against a 1000-bit mask (125 bytes): the mask wins.
    assert t[("replica_sync", "all_gather")].payload_bytes == pytest.approx(1000 / 8 / 4)
    bf16 = _by_purpose(workload_traffic(shape, StrategyChoice(sharding_group_size=2, sync=ReplicaSyncConfig(every_n_steps=4, precision="bf16")), two_d))
    assert bf16[("replica_sync", "all_reduce")].payload_bytes == pytest.approx((rows_per_rank * 17 * 2 + 8) / 4)
    whole = _by_purpose(workload_traffic(shape, StrategyChoice(sharding_group_size=2, sync=ReplicaSyncConfig(rows="all", every_n_steps=4)), two_d))
    assert whole[("replica_sync", "all_reduce")].payload_bytes == pytest.approx(2 * 1000 * 17 * 4 / 2 / 4)
    assert overlapped_purposes(StrategyChoice(sharding_group_size=2, sync=ReplicaSyncConfig(overlap=True))) == ("dense_grads", "replica_sync")
    assert overlapped_purposes(StrategyChoice()) == ("dense_grads",)


def test_touched_sync_union_comes_from_the_whole_worlds_examples():
    # Without a stated fraction: the union over the replica group is the Zipf union of every rank's ids.
    f = Feature(name="t", rows=10**6, dim=16, ids_per_example=2)
    shape = ModelShape(name="x", batch_per_rank=1024, features=(f,), dense_param_bytes=0, optimizer_state_per_row=0)
    t = _by_purpose(workload_traffic(shape, StrategyChoice(sharding_group_size=2), topology_for(EMULATED, 2)))
    union = expected_distinct(10**6, 1024 * 4 * 2, 1.05)
    assert t[("replica_sync", "all_reduce")].payload_bytes == pytest.approx(union * 16 * 4 / 2 + 8)


def test_all_gather_sync_sends_each_replicas_own_rows_with_ids_and_scaled_changes():
    f = Feature(name="t", tables=2, rows=10**6, dim=16, ids_per_example=2)
    shape = ModelShape(name="x", batch_per_rank=1024, features=(f,), dense_param_bytes=0, optimizer_state_per_row=1)
    two_d = topology_for(EMULATED, 2)
    own = 2 * expected_distinct(10**6, 4 * 1024 * 2 * 2, 1.05) / 2  # one replica: its sharding group's 2 ranks, 4 steps
    union = 2 * expected_distinct(10**6, 4 * 1024 * 4 * 2, 1.05) / 2
    for precision, change in (("fp32", 64), ("bf16", 32), ("fp8", 16 + 4)):
        sync = ReplicaSyncConfig(every_n_steps=4, precision=precision, exchange="all_gather")  # type: ignore[arg-type]
        t = _by_purpose(workload_traffic(shape, StrategyChoice(sharding_group_size=2, sync=sync), two_d))
        assert ("replica_sync", "all_reduce") not in t  # no union agreement, no all-reduce
        # Per row: a 4-byte id, the weights' change, the Adagrad state's change in fp32; plus 8 bytes per table's count.
        assert t[("replica_sync", "all_gather")].payload_bytes == pytest.approx((own * (4 + change + 4) + 8 * 2 / 2) / 4)
    # Long-tail ids over 2 replicas: a replica's own rows are most of the union, so sending them beats all-reducing the union.
    assert own < union < 2 * own
    bf16 = ReplicaSyncConfig(every_n_steps=4, precision="bf16")
    reduce_bytes = sum(c.payload_bytes  # over 2 replicas a ring's edge carries the payload once, all-reduce or all-gather
                       for c in workload_traffic(shape, StrategyChoice(sharding_group_size=2, sync=bf16), two_d) if c.purpose == "replica_sync")
    gather = ReplicaSyncConfig(every_n_steps=4, precision="bf16", exchange="all_gather")
    gather_bytes = sum(c.payload_bytes for c in workload_traffic(shape, StrategyChoice(sharding_group_size=2, sync=gather), two_d)
                       if c.purpose == "replica_sync")
    assert gather_bytes < reduce_bytes
    print(f"bf16 sync every 4, bytes per step and rank: all-reduce {reduce_bytes:,.0f}, all-gather {gather_bytes:,.0f}")


def _sequence_heavy(compute_s: float) -> ModelShape:
    return ModelShape(
        name="seq", batch_per_rank=512, dense_param_bytes=4 * 50e6, compute_s=compute_s,
        features=(Feature(name="items", rows=10**8, dim=128, ids_per_example=256, pooled=False),
                  Feature(name="ctx", tables=8, rows=10**6, dim=64, ids_per_example=2)),
    )  # fmt: skip


def test_advice_picks_2d_for_sequence_histories_and_1d_for_single_hot_long_tails():
    advice = recommend(_sequence_heavy(0.06), Hardware(), 8)
    assert advice.best.layout.is_2d and advice.best.layout.sync.every_n_steps <= 4
    assert advice.best.scaling > advice.best_other_kind.scaling
    assert advice.confidence in ("high", "medium", "low") and advice.perturbations == 6
    # Uniform single-hot ids over huge tables: the union is the whole batch, and FP8 1D moves fewer bytes.
    long_tail = ModelShape(
        name="tail", batch_per_rank=8192, dense_param_bytes=4e6, compute_s=0.002,
        features=(Feature(name="c", tables=26, rows=4 * 10**7, dim=128, ids_per_example=1, zipf_exponent=0.0),),
    )  # fmt: skip
    advice = recommend(long_tail, Hardware(), 8)
    assert not advice.best.layout.is_2d and advice.best.layout.forward == "fp8"
    assert any("7.5x on 8 nodes needs" in r for r in advice.reasons)
    text = "\n".join(advice.lines())
    assert "recommended: 1D" in text and "confidence:" in text


def test_a_tie_goes_to_1d():
    # Compute so large that every layout scales linearly: no reason to pay for 2D's replicas.
    advice = recommend(_sequence_heavy(100.0), Hardware(), 8)
    assert not advice.best.layout.is_2d
    assert advice.confidence == "low" and any("within 5%" in r for r in advice.reasons)
    # The perturbed assumptions are decided by the same rule, ties included: they all pick 1D too.
    assert advice.agreeing == advice.perturbations
    assert "6/6 perturbed assumptions pick 1D" in "\n".join(advice.lines())


def test_parse_cluster_and_profile_shapes():
    assert parse_cluster("8x8") == (8, 8, None)
    assert parse_cluster("4X8@200") == (4, 8, 200.0)
    for bad in ("8", "0x8", "8x8@0", "eightxeight"):
        with pytest.raises(ValueError, match="NODESxGPUS"):
            parse_cluster(bad)
    shape, assumed = shape_from_tables("p", [("a", 10**6, 16, 2.0, hot_row_share(10**6, 1.2), True), ("b", 1000, 8, 1.0, None, False)],
                                       batch_per_rank=64, dense_param_bytes=10)  # fmt: skip
    assert shape.features[0].zipf_exponent == pytest.approx(1.2, abs=1e-6)
    assert not shape.features[1].pooled and shape.features[1].zipf_exponent == 1.05
    assert len(assumed) == 1 and "b" in assumed[0]


def test_a_staged_dense_all_reduce_is_one_all_reduce_inside_the_sharding_group_and_one_across_replicas():
    shape = ModelShape(name="x", batch_per_rank=8, features=(Feature(name="t", rows=100, dim=4, ids_per_example=1),), dense_param_bytes=64)
    two_d, one_d = topology_for(EMULATED, 2), topology_for(EMULATED, None)

    def dense(layout: StrategyChoice, topology, staged: bool) -> list[tuple[str, float]]:
        return [(c.group, c.payload_bytes) for c in workload_traffic(shape, layout, topology, staged_dense=staged) if c.purpose == "dense_grads"]

    assert dense(StrategyChoice(sharding_group_size=2), two_d, True) == [("shard", 64), ("replicate", 64)]
    assert dense(StrategyChoice(sharding_group_size=2), two_d, False) == [("world", 64)]  # NCCL: its own flat all-reduce
    assert dense(StrategyChoice(), one_d, True) == [("world", 64)]  # 1D is never staged

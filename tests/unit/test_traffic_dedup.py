"""TorchRec's sequence index dedup in the traffic model: unique ids per rank against exact counts, bytes by hand, advice."""

import math

import pytest
import torch

from lightning_recsys.parallel.topology import ParallelTopology
from lightning_recsys.planner.cost.cost_model import Cluster, Link, row_bytes, topology_for
from lightning_recsys.planner.cost.layout_advice import Hardware, candidate_layouts, has_sequence_features, recommend
from lightning_recsys.planner.cost.traffic_model import (
    Feature,
    ModelShape,
    StrategyChoice,
    expected_distinct,
    ids_sent_per_rank,
    workload_traffic,
)

EMULATED = Cluster(nodes=2, ranks_per_node=2, intra=Link.free(), inter=Link(bandwidth_bytes_per_s=25e6, latency_s=1e-3))


def _sampled_rank_batches(rows: int, exponent: float, batch: int, length: int, ranks: int, seed: int) -> torch.Tensor:
    """``ranks`` batches of ``batch`` sequences of ``length`` i.i.d. Zipf ids (inverse-CDF sampling, fixed seed)."""
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** exponent
    cdf = torch.cumsum(weights / weights.sum(), 0)
    gen = torch.Generator().manual_seed(seed)
    uniform = torch.rand(ranks, batch * length, generator=gen, dtype=torch.float64)
    return torch.searchsorted(cdf, uniform).clamp_(max=rows - 1)


@pytest.mark.parametrize("exponent", [0.0, 0.8, 1.05, 1.3])
@pytest.mark.parametrize("rows,batch,length", [(1_000, 32, 16), (20_000, 64, 64), (400_000, 256, 64)])
def test_unique_ids_per_rank_match_an_exact_count_on_sampled_zipf_batches(rows, batch, length, exponent):
    ranks = 6
    feature = Feature(name="history", rows=rows, dim=8, ids_per_example=length, pooled=False, zipf_exponent=exponent)
    expected = ids_sent_per_rank(feature, batch, index_dedup=True)
    # What index dedup keeps on each rank: the distinct ids of that rank's own batch (one table).
    exact = [ids.unique().numel() for ids in _sampled_rank_batches(rows, exponent, batch, length, ranks, seed=rows + length)]
    mean = sum(exact) / ranks
    # The distinct count is a sum of negatively associated "row hit" indicators, so its variance is at
    # most its mean: the mean of `ranks` samples has a standard deviation <= sqrt(E/ranks). Allow 4 of
    # them, plus 0.5% for the tail integral beyond the 4096 exactly summed rows (400k-row case).
    tolerance = 4 * math.sqrt(expected / ranks) + 0.005 * expected
    assert abs(mean - expected) <= tolerance, (mean, expected, tolerance)
    assert ids_sent_per_rank(feature, batch, index_dedup=False) == batch * length


def _shape(*, exponent: float = 1.05) -> ModelShape:
    return ModelShape(
        name="dedup", batch_per_rank=8, dense_param_bytes=64.0,
        features=(
            Feature(name="history", tables=2, rows=1_000, dim=16, ids_per_example=20, pooled=False, zipf_exponent=exponent),
            Feature(name="context", tables=3, rows=500, dim=16, ids_per_example=4, pooled=True, zipf_exponent=exponent),
        ),
    )  # fmt: skip


def _by_purpose(collectives):
    out = {}
    for c in collectives:
        out[c.purpose] = out.get(c.purpose, 0.0) + c.payload_bytes
    return out


@pytest.mark.parametrize("forward,backward", [("fp32", "fp32"), ("fp8", "bf16")])
def test_deduped_sequence_all_to_all_bytes_by_hand(forward, backward):
    shape, b = _shape(), 8
    one_d = topology_for(EMULATED, None)
    plain = _by_purpose(workload_traffic(shape, StrategyChoice(forward=forward, backward=backward), one_d))
    dedup = _by_purpose(workload_traffic(shape, StrategyChoice(forward=forward, backward=backward, index_dedup=True), one_d))
    unique = expected_distinct(1_000, b * 20, 1.05)  # per sequence table, one rank's batch
    vector = row_bytes(16, forward) + row_bytes(16, backward)
    # Sequence ids shrink to the unique ones; lengths stay per example; pooled features are untouched.
    assert dedup["sparse_ids"] == pytest.approx(2 * (unique * 8 + b * 8) + 3 * (b * 4 * 8 + b * 8))
    assert plain["sparse_ids"] == pytest.approx(2 * (b * 20 * 8 + b * 8) + 3 * (b * 4 * 8 + b * 8))
    assert dedup["embeddings"] == pytest.approx(2 * unique * vector + 3 * b * vector)
    assert plain["embeddings"] == pytest.approx(2 * b * 20 * vector + 3 * b * vector)
    assert dedup["dense_grads"] == plain["dense_grads"]


def test_dedup_changes_nothing_for_pooled_features_and_cuts_hot_sequence_bytes():
    one_d = topology_for(EMULATED, None)
    pooled = ModelShape(name="pooled", batch_per_rank=8, dense_param_bytes=0.0,
                        features=(Feature(name="c", rows=500, dim=16, ids_per_example=4, zipf_exponent=1.3),))  # fmt: skip
    assert workload_traffic(pooled, StrategyChoice(index_dedup=True), one_d) == workload_traffic(pooled, StrategyChoice(), one_d)

    def embedding_ratio(exponent: float, rows: int) -> float:
        shape = ModelShape(name="s", batch_per_rank=64, dense_param_bytes=0.0,
                           features=(Feature(name="h", rows=rows, dim=16, ids_per_example=64, pooled=False, zipf_exponent=exponent),))  # fmt: skip
        on = _by_purpose(workload_traffic(shape, StrategyChoice(index_dedup=True), one_d))["embeddings"]
        return on / _by_purpose(workload_traffic(shape, StrategyChoice(), one_d))["embeddings"]

    assert embedding_ratio(0.0, 10_000_000) > 0.99  # uniform ids over many rows barely repeat
    assert embedding_ratio(1.3, 10_000_000) < 0.3  # hot ids repeat within one rank's batch


def test_dedup_applies_inside_the_sharding_group_in_2d_too():
    shape = _shape()
    two_d = ParallelTopology(world_size=4, sharding_group_size=2)
    plain = _by_purpose(workload_traffic(shape, StrategyChoice(sharding_group_size=2), two_d))
    dedup = _by_purpose(workload_traffic(shape, StrategyChoice(sharding_group_size=2, index_dedup=True), two_d))
    assert dedup["embeddings"] < plain["embeddings"]
    assert dedup["replica_sync"] == plain["replica_sync"]  # the union of touched rows does not depend on dedup


def test_index_dedup_is_validated_and_described():
    with pytest.raises(ValueError, match="index_dedup"):
        StrategyChoice(index_dedup="yes")  # type: ignore[arg-type]
    assert "deduped" in StrategyChoice(index_dedup=True).describe()
    assert "deduped" not in StrategyChoice().describe()


def test_advice_compares_2d_against_deduped_1d_on_sequence_workloads_only():
    assert any(not c.is_2d and c.index_dedup for c in candidate_layouts())
    assert not any(c.index_dedup for c in candidate_layouts(index_dedup=False))
    sequence = ModelShape(
        name="seq", batch_per_rank=256, dense_param_bytes=4e6, compute_s=0.02,
        features=(Feature(name="h", rows=1_000_000, dim=64, ids_per_example=64, pooled=False, zipf_exponent=1.3),),
    )  # fmt: skip
    pooled = ModelShape(name="pooled", batch_per_rank=256, dense_param_bytes=4e6, compute_s=0.02,
                        features=(Feature(name="c", rows=1_000_000, dim=64, ids_per_example=1),))  # fmt: skip
    assert has_sequence_features(sequence) and not has_sequence_features(pooled)
    advice = recommend(sequence, Hardware(), 8)
    best_1d = advice.best_other_kind if advice.best.layout.is_2d else advice.best
    assert best_1d.layout.index_dedup  # hot histories: the deduped 1D is the 1D to beat
    plain_1d = [p for p in advice.runner_ups + (advice.best, advice.best_other_kind) if not p.layout.is_2d and not p.layout.index_dedup]
    assert all(best_1d.step_s < p.step_s for p in plain_1d)
    pooled_advice = recommend(pooled, Hardware(), 8)
    assert not pooled_advice.best.layout.index_dedup and not pooled_advice.best_other_kind.layout.index_dedup

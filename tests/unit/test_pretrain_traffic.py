"""The pretraining traffic model against exact counts on sampled batches: ids per feature, with and without dedup."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torchrec import KeyedJaggedTensor

from lightning_recsys.parallel.comms.lookup_traffic import ShardPiece, TableRoute, feature_ids, lookup_bytes
from lightning_recsys.parallel.topology import ParallelTopology
from lightning_recsys.planner.cost import StrategyChoice, topology_for, workload_traffic
from lightning_recsys.planner.cost.cost_model import Cluster, Link, row_bytes
from lightning_recsys.planner.cost.pretrain_traffic import (
    HISTORY, NEGATIVES, TARGETS, PretrainItemFeature, PretrainWorkload, ranking_eval_traffic,
)

ROUTE = TableRoute(table="item", features=(HISTORY, TARGETS, NEGATIVES), pieces=())


@functools.lru_cache(maxsize=8)
def _cdf(rows: int, exponent: float) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** exponent
    return torch.cumsum(weights / weights.sum(), 0)


def _zipf(rows: int, exponent: float, count: int, gen: torch.Generator) -> torch.Tensor:
    cdf = _cdf(rows, exponent)
    return torch.searchsorted(cdf, torch.rand(count, generator=gen, dtype=torch.float64)).clamp_(max=rows - 1)


def sampled_batch(
    rows: int, exponent: float, lengths: torch.Tensor, pool: int, gen: torch.Generator, popular_pool: bool = False
) -> KeyedJaggedTensor:
    """One rank's pretraining batch: per example ``length + 1`` i.i.d. Zipf items (inputs, then targets shifted by one)
    and a shared pool of ``pool`` negatives (uniform, or by the same Zipf law), spread over the examples."""
    items = _zipf(rows, exponent, int(lengths.sum()) + lengths.numel(), gen)
    inputs, targets, start = [], [], 0
    for length in lengths.tolist():
        inputs.append(items[start : start + length])
        targets.append(items[start + 1 : start + length + 1])
        start += length + 1
    negatives = _zipf(rows, exponent, pool, gen) if popular_pool else torch.randint(0, rows, (pool,), generator=gen)
    b = lengths.numel()
    spread = torch.full((b,), pool // b, dtype=torch.long)
    spread[: pool % b] += 1
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[HISTORY, TARGETS, NEGATIVES], values=torch.cat([*inputs, *targets, negatives]), lengths=torch.cat([lengths, lengths, spread])
    )


def _beauty_like_lengths(batch: int, gen: torch.Generator, max_length: int = 50) -> torch.Tensor:
    # Amazon Beauty's sequences are short with a long tail (mean about 9 items): geometric, cut at max_length.
    return torch.clamp(torch.distributions.Geometric(probs=torch.tensor(1 / 7.0)).sample((batch,)).long() + 1, max=max_length)


@pytest.mark.parametrize("exponent", [0.0, 0.8, 1.1])
@pytest.mark.parametrize("rows,batch,pool", [(2_000, 32, 64), (100_000, 128, 512), (1_000_000, 256, 1024)])
@pytest.mark.parametrize("popular_pool", [False, True])
def test_ids_per_feature_match_exact_counts_on_sampled_batches(rows, batch, pool, exponent, popular_pool):
    gen = torch.Generator().manual_seed(rows + batch)
    ranks = 6
    exact = {True: {HISTORY: 0.0, TARGETS: 0.0, NEGATIVES: 0.0}, False: {HISTORY: 0.0, TARGETS: 0.0, NEGATIVES: 0.0}}
    tokens = 0
    for _ in range(ranks):
        lengths = _beauty_like_lengths(batch, gen)
        tokens += int(lengths.sum())
        kjt = sampled_batch(rows, exponent, lengths, pool, gen, popular_pool)
        for dedup in (True, False):  # the accounting's own attribution (parallel/comms/lookup_traffic.py)
            for name, ids in feature_ids(kjt, ROUTE, index_dedup=dedup).items():
                exact[dedup][name] += ids.numel() / ranks
    workload = PretrainWorkload(
        items=rows, dim=16, batch_per_rank=batch, tokens_per_example=tokens / (ranks * batch), num_negatives=pool,
        zipf_exponent=exponent, negative_sampling="popularity" if popular_pool else "uniform",
    )
    for dedup in (True, False):
        expected = workload.ids_per_rank(index_dedup=dedup)
        for name in (HISTORY, TARGETS, NEGATIVES):
            # A distinct count's variance is at most its mean (negatively associated indicators); 4 standard
            # deviations of the mean of `ranks` samples, plus 2% for the tail integral and the lengths' spread.
            tolerance = 4 * math.sqrt(max(expected[name], 1.0) / ranks) + 0.02 * expected[name] + 1
            assert abs(exact[dedup][name] - expected[name]) <= tolerance, (dedup, name, exact[dedup][name], expected[name], tolerance)


def test_from_batches_learns_the_workload_and_predicts_a_larger_batch():
    gen = torch.Generator().manual_seed(7)
    rows, exponent = 200_000, 1.0
    small = [sampled_batch(rows, exponent, _beauty_like_lengths(64, gen), 256, gen) for _ in range(6)]
    learned = PretrainWorkload.from_batches(small, items=rows, dim=16)
    assert learned.batch_per_rank == 64 and learned.num_negatives == 256
    assert abs(learned.zipf_exponent - exponent) < 0.1, learned.zipf_exponent
    large = [sampled_batch(rows, exponent, _beauty_like_lengths(512, gen), 256, gen) for _ in range(3)]
    exact = sum(feature_ids(kjt, ROUTE, index_dedup=True)[HISTORY].numel() for kjt in large) / len(large)
    tokens = sum(int(kjt[HISTORY].values().numel()) for kjt in large) / len(large)
    predicted = PretrainWorkload(items=rows, dim=16, batch_per_rank=512, tokens_per_example=tokens / 512, num_negatives=256,
                                 zipf_exponent=learned.zipf_exponent).ids_per_rank(index_dedup=True)[HISTORY]
    assert abs(predicted / exact - 1) < 0.1, (predicted, exact)


def test_workload_bytes_are_the_parts_times_the_wire_bytes_and_match_the_accounting_split():
    workload = PretrainWorkload(items=10_000, dim=16, batch_per_rank=8, tokens_per_example=5.0, num_negatives=16, zipf_exponent=1.0)
    shape = workload.model_shape(dense_param_bytes=100.0)
    cluster = Cluster(nodes=2, ranks_per_node=2, intra=Link.free(), inter=Link(bandwidth_bytes_per_s=25e6, latency_s=1e-3))
    for dedup in (False, True):
        layout = StrategyChoice(forward="fp8", backward="bf16", index_dedup=dedup)
        collectives = workload_traffic(shape, layout, topology_for(cluster, None))
        embeddings = sum(c.payload_bytes for c in collectives if c.purpose == "embeddings")
        ids = sum(workload.ids_per_rank(index_dedup=dedup).values())
        assert embeddings == pytest.approx(ids * (row_bytes(16, "fp8") + row_bytes(16, "bf16")))
        sparse = sum(c.payload_bytes for c in collectives if c.purpose == "sparse_ids")
        assert sparse == pytest.approx(ids * 8 + 3 * 8 * 8)  # three features: one length per example each
    # The accounting's split of a hand-made batch, by hand: rows 0-49 on rank 0 (node 0), 50-99 on rank 2 (node 1).
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[HISTORY, TARGETS, NEGATIVES], values=torch.tensor([1, 60, 1, 60, 61, 61, 99, 2]), lengths=torch.tensor([2, 1, 2, 1, 1, 1])
    )
    pieces = (ShardPiece(row_start=0, row_end=50, cols=16, owner=0), ShardPiece(row_start=50, row_end=100, cols=16, owner=2))
    route = TableRoute(table="item", features=(HISTORY, TARGETS, NEGATIVES), pieces=pieces)
    topology = ParallelTopology(world_size=4, sharding_group_size=4, ranks_per_node=2)
    split = lookup_bytes(kjt, [route], index_dedup=True, wire_bytes=(1.25, 2.0), topology=topology, rank=1)
    assert {k: (v.ids, v.payload_bytes, v.inter_node_bytes) for k, v in split.items()} == {
        ("embeddings", HISTORY): (2, 40, 20), ("gradients", HISTORY): (2, 64, 32),  # 1, 60
        ("embeddings", TARGETS): (1, 20, 20), ("gradients", TARGETS): (1, 32, 32),  # 61 (60 is an input)
        ("embeddings", NEGATIVES): (2, 40, 20), ("gradients", NEGATIVES): (2, 64, 32),  # 99, 2 (61 is a target)
    }


def test_the_feature_is_validated_and_the_eval_exchange_counts_by_hand():
    with pytest.raises(ValueError, match="negative_sampling"):
        PretrainItemFeature(name="item", rows=10, dim=4, ids_per_example=3.0, pooled=False, tokens_per_example=1.0, batch_per_rank=2,
                            num_negatives=2, negative_sampling="in_batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_negatives"):
        PretrainWorkload(items=10, dim=4, batch_per_rank=2, tokens_per_example=1.0, num_negatives=-1)
    rows = {c.op: c.payload_bytes for c in ranking_eval_traffic(batch_per_rank=4, dim=8, seen_per_example=3, group_size=2)}
    assert rows == {"all_gather": 32 + 4 * 16 + 4 * 8 * 4 + 4 * 3 * 8, "all_reduce": 8 * 8 * 4 + 8 * 8}


def test_layout_advice_covers_pretraining_and_negatives_per_example_favour_deduped_1d():
    from lightning_recsys.planner.cost.layout_advice import Hardware, recommend

    def advice(shared: bool):
        workload = PretrainWorkload(items=100_000_000, dim=128, batch_per_rank=256, tokens_per_example=6.0,
                                    num_negatives=1024 if shared else 128, shared_negatives=shared, zipf_exponent=1.05)  # fmt: skip
        return workload, recommend(workload.model_shape(dense_param_bytes=8e7, compute_s=0.002), Hardware(), 8)

    per_example, per_example_advice = advice(shared=False)
    assert not per_example_advice.best.layout.is_2d and per_example_advice.best.layout.index_dedup
    assert per_example_advice.best.layout.forward == "fp8" and per_example_advice.confidence == "high"
    # A 2D sync's union of touched rows holds every replica's negatives: 128 per example over 8 GPUs' batches
    # touch far more rows than the history alone.
    feature = per_example.item_feature()
    union = feature.distinct(8 * 256 * feature.ids_per_example)
    assert union > 0.9 * 8 * 256 * 128
    pooled, _ = advice(shared=True)
    assert pooled.item_feature().distinct(8 * 256 * pooled.item_feature().ids_per_example) < union / 10


@pytest.mark.parametrize("dedup", [False, True])
def test_sync_free_counts_equal_the_attributed_ids_per_shard(dedup):
    from lightning_recsys.parallel.comms.lookup_traffic import lookup_counts

    gen = torch.Generator().manual_seed(3)
    kjt = sampled_batch(500, 1.1, _beauty_like_lengths(16, gen, max_length=12), 40, gen)
    pieces = (ShardPiece(row_start=0, row_end=200, cols=8, owner=0), ShardPiece(row_start=200, row_end=500, cols=4, owner=1),
              ShardPiece(row_start=200, row_end=500, cols=4, owner=2, col_start=4))  # fmt: skip
    route = TableRoute(table="item", features=(HISTORY, TARGETS, NEGATIVES), pieces=pieces)
    counts = lookup_counts(kjt, route, index_dedup=dedup)
    ids = feature_ids(kjt, route, index_dedup=dedup)
    expected = [[int(((ids[f] >= p.row_start) & (ids[f] < p.row_end)).sum()) for p in pieces] for f in route.features]
    assert counts.tolist() == expected
    assert 0 < counts.sum() and (not dedup or counts[1].sum() < counts[0].sum())

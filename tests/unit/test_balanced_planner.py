"""BalancedPlanner, plan reports and reshape advice, in one process with fake topologies (no process group)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.planner.types import PlannerError

from lightning_recsys import EmbeddingOptimizerConfig, TableConstraints
from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import DLRMRanker
from lightning_recsys.parallel import make_sharders
from lightning_recsys.parallel.sharding.reshape import remap_ids
from lightning_recsys.planner import (
    BalancedPlanner,
    BalanceObjective,
    CommCosts,
    Imbalance,
    ReshapedEmbeddingBagCollection,
    TableStats,
    apply_reshape,
    build_plan_report,
    embedding_tables,
    make_sharding_plan,
    plan_rows,
    suggest_reshape,
)

BATCH = 64  # examples per rank per step in these plans
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _model(table_sizes: list[int], dim: int = 8, device: str = "meta") -> DLRMRanker:
    return DLRMRanker(table_sizes=table_sizes, embedding_dim=dim, dense_arch_layer_sizes=[8, dim], embedding_device=device)


def _sharders() -> list:
    return make_sharders(EmbeddingOptimizerConfig(name="sgd").fused_params())


def _rows_of(plan, table: str) -> dict:
    return next(row for row in plan_rows(plan) if row["table"] == table)


def _shards(plan, table: str) -> list[tuple[int, int, int]]:
    """(row offset, rows, rank) of every shard of ``table``."""
    for module_plan in plan.plan.values():
        if table in module_plan:
            sharding = module_plan[table]
            return [(m.shard_offsets[0], m.shard_sizes[0], r) for m, r in zip(sharding.sharding_spec.shards, sharding.ranks)]
    raise KeyError(table)


# ----------------------------------------------------------------------------------- hash partitions
@pytest.mark.parametrize(("rows", "partitions", "group"), [(1024, 16, 4), (1000, 40, 8)])
def test_hashed_table_is_row_wise_on_partition_boundaries(rows, partitions, group):
    model = _model([rows, 200, 300])
    planner = BalancedPlanner(sharding_group_size=group, batch_size=BATCH, hash_partitions={"t_sparse_0": partitions})
    plan = planner.plan(model, _sharders())
    assert _rows_of(plan, "t_sparse_0")["sharding_type"] == "row_wise"
    shards = _shards(plan, "t_sparse_0")
    partition_rows = rows // partitions
    assert sorted(r for _, _, r in shards) == list(range(group))
    assert sum(size for _, size, _ in shards) == rows
    for offset, size, _ in shards:
        assert offset % partition_rows == 0 and size % partition_rows == 0
        assert size // partition_rows == partitions // group  # the same whole number of partitions on every rank


def test_partition_count_not_divisible_by_the_group_suggests_one():
    model = _model([1536, 100])
    with pytest.raises(ValueError, match=r"hash_partitions\['t_sparse_0'\]=12 is not divisible by the sharding group size 8") as err:
        BalancedPlanner(sharding_group_size=8, hash_partitions={"t_sparse_0": 12}).plan(model, _sharders())
    suggested = [int(p) for p in re.findall(r"\d+", str(err.value).split("e.g.")[-1])]
    assert suggested and all(p % 8 == 0 and 1536 % p == 0 for p in suggested)


def test_partitions_that_do_not_divide_the_rows_are_an_error():
    with pytest.raises(ValueError, match=r"has 1000 rows, which do not split into 48 equal partitions"):
        BalancedPlanner(sharding_group_size=8, hash_partitions={"t_sparse_0": 48}).plan(_model([1000]), _sharders())


def test_hash_partitions_conflicting_with_table_constraints_is_an_error():
    planner = BalancedPlanner(
        sharding_group_size=2,
        hash_partitions={"t_sparse_0": 4},
        constraints={"t_sparse_0": TableConstraints(sharding_types=["table_wise"])},
    )
    with pytest.raises(ValueError, match="excludes 'row_wise'"):
        planner.plan(_model([64, 32]), _sharders())


# ----------------------------------------------------------------------------------- imbalance and costs
def test_imbalance_is_max_over_mean():
    values = [1.0, 3.0, 2.0, 2.0]
    imbalance = Imbalance.of(values)
    assert imbalance.max == max(values) and imbalance.mean == sum(values) / len(values)
    assert imbalance.ratio == pytest.approx(max(values) / (sum(values) / len(values)))
    assert Imbalance.of([0.0, 0.0]).ratio == 1.0
    with pytest.raises(ValueError, match="at least one rank"):
        Imbalance.of([])


def test_objective_charges_imbalance_above_the_tolerance_only():
    objective = BalanceObjective(tolerance=0.05, excess_penalty=10.0, storage=0.5)
    assert objective.metric_cost(0, peak=1.04, mean=1.0) == pytest.approx(0.5 * 1.04)
    assert objective.metric_cost(0, peak=1.25, mean=1.0) == pytest.approx(0.5 * (1.25 + 10.0 * (1.25 - 1.05)))
    with pytest.raises(ValueError, match="tolerance"):
        BalanceObjective(tolerance=-0.1)
    with pytest.raises(ValueError, match="not all 0"):
        BalanceObjective(storage=0, lookups=0, comm=0, step_time=0)


def test_row_block_shares_weight_row_ranges():
    stats = TableStats(pooling_factor=2.0, row_block_shares=(0.5, 0.25, 0.25))
    assert stats.share_of_rows(0, 6, 6) == pytest.approx(1.0)
    assert stats.share_of_rows(0, 3, 6) == pytest.approx(0.5 + 0.25 / 2)  # block 1 covers rows 2-3
    assert TableStats(pooling_factor=1.0).share_of_rows(0, 25, 100) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="must sum to 1"):
        TableStats(pooling_factor=1.0, row_block_shares=(0.5, 0.4))
    with pytest.raises(ValueError, match="pooling_factor"):
        TableStats(pooling_factor=0.0)


def test_report_of_a_tiny_plan_adds_up():
    group, dim = 2, 8
    model = _model([100, 200, 400], dim=dim)
    stats = {
        "t_sparse_0": TableStats(pooling_factor=3.0),
        "t_sparse_1": TableStats(pooling_factor=1.5),
        "t_sparse_2": TableStats(pooling_factor=2.0, row_block_shares=(0.7, 0.1, 0.1, 0.1)),
    }
    constraints = {
        "t_sparse_0": TableConstraints(sharding_types=["table_wise"]),
        "t_sparse_2": TableConstraints(sharding_types=["row_wise"]),
    }
    sharders = _sharders()
    plan = BalancedPlanner(sharding_group_size=group, batch_size=BATCH, stats=stats, constraints=constraints).plan(model, sharders)
    report = build_plan_report(
        plan, model, sharders, sharding_group_size=group, batch_size=BATCH, stats=stats, table_constraints=constraints, planner="balanced"
    )
    comm = CommCosts()  # no QComms: fp32 both ways, int64 ids
    assert [r.rank for r in report.ranks] == list(range(group))
    assert {t.name for t in report.tables} == set(stats)
    # Lookups (full-width rows) are conserved whatever the plan: the whole group's batch, every id once.
    total = sum(r.lookups for r in report.ranks)
    assert total == pytest.approx(BATCH * group * sum(s.lookups_per_example for s in stats.values()))
    for rank in report.ranks:
        mine = [s for s in report.shards if s.rank == rank.rank]
        assert rank.a2a_bytes == pytest.approx(sum(s.a2a_bytes for s in mine))
        assert rank.storage_bytes == pytest.approx(sum(s.storage_bytes for s in mine)) and rank.storage_bytes > 0
    for metric, attr in (("lookups", "lookups"), ("a2a_bytes", "a2a_bytes"), ("storage_bytes", "storage_bytes")):
        values = [getattr(r, attr) for r in report.ranks]
        assert report.imbalance[metric].ratio == pytest.approx(max(values) / (sum(values) / len(values)))
    tw = next(s for s in report.shards if s.table == "t_sparse_0")
    peers = group - 1
    assert tw.a2a_bytes == pytest.approx(BATCH * peers * (dim * (comm.pooled_all_to_all.forward + comm.pooled_all_to_all.backward) + 3.0 * comm.index_bytes))
    rw = sorted((s for s in report.shards if s.table == "t_sparse_2"), key=lambda s: s.row_offset)
    shares = [stats["t_sparse_2"].share_of_rows(s.row_offset, s.row_offset + s.rows, 400) for s in rw]
    assert shares[0] > shares[1]  # the hot first row block
    for shard, share in zip(rw, shares):
        assert shard.lookups == pytest.approx(BATCH * group * 2.0 * share)
    assert report.step_time_ms == max(r.step_time_ms for r in report.ranks) > 0
    text = report.to_table()
    assert "max/mean" in text and all(name in text for name in stats)
    payload = json.loads(json.dumps(report.to_json()))
    assert len(payload["ranks"]) == group and payload["imbalance"]["lookups"]["max_over_mean"] == pytest.approx(report.imbalance["lookups"].ratio)


def test_report_measures_torchrec_default_plans_too():
    model = _model([100, 200, 300])
    sharders = _sharders()
    plan = make_sharding_plan(model, sharders, sharding_group_size=2, group_ranks_per_node=2, compute_device="cpu")
    report = build_plan_report(plan, model, sharders, sharding_group_size=2, batch_size=BATCH, planner="default")
    assert {t.name for t in report.tables} == {"t_sparse_0", "t_sparse_1", "t_sparse_2"}
    assert sum(len(r.shards) for r in report.ranks) == len(report.shards) > 0
    assert all(t.stats_source == "assumed" for t in report.tables)


# ----------------------------------------------------------------------------------- memory
def test_infeasible_memory_raises_planner_error_naming_the_table():
    memory = 256 << 10
    planner = BalancedPlanner(sharding_group_size=2, batch_size=BATCH, memory_per_rank=memory)
    with pytest.raises(PlannerError) as err:
        planner.plan(_model([50_000, 100], dim=16), _sharders())
    message = str(err.value)
    found = re.search(r"table 't_sparse_0' needs at least ([\d.]+) (\w+) on one rank .* but a rank has ([\d.]+) (\w+)", message)
    assert found, message
    needs = float(found.group(1)) * UNITS[found.group(2)]
    has = float(found.group(3)) * UNITS[found.group(4)]
    assert has <= memory < needs
    assert "'t_sparse_1'" not in message.split("TorchRec")[0]  # the small table fits and is not blamed


# ----------------------------------------------------------------------------------- profiling
def test_profile_counts_the_datamodule_ids():
    config = SyntheticClickLogConfig(table_sizes=[50, 80], pooling_factors=[2.0, 3.0], global_batch_size=32, train_batches=4)
    datamodule = SyntheticClickLogDataModule.from_config(config)
    profile = BalancedPlanner.profile(datamodule, batches=3)
    assert profile.batches == 3 and profile.examples == 3 * config.global_batch_size
    stats = profile.table_stats(embedding_tables(_model(config.table_sizes)))
    batches = [b for _, b in zip(range(3), datamodule.train_dataloader())]
    for i, rows in enumerate(config.table_sizes):
        ids = torch.cat([b.sparse[f"sparse_{i}"].values() for b in batches])
        table = stats[f"t_sparse_{i}"]
        assert table.pooling_factor == pytest.approx(ids.numel() / profile.examples)
        counts = torch.bincount(ids, minlength=rows).double()
        hot = math.ceil(0.01 * rows)
        assert table.hot_row_share == pytest.approx(float(counts.topk(hot).values.sum() / counts.sum()))
        assert (table.sampled_lookups, table.sampled_distinct_rows) == (ids.numel(), ids.unique().numel())
        assert sum(table.row_block_shares) == pytest.approx(1.0)


# ----------------------------------------------------------------------------------- reshape
def test_reshape_advice_keeps_parameters_and_cuts_bytes():
    tables = [
        EmbeddingBagConfig(name="wide", embedding_dim=16, num_embeddings=100, feature_names=["a"]),
        EmbeddingBagConfig(name="narrow", embedding_dim=8, num_embeddings=100, feature_names=["b"]),
        EmbeddingBagConfig(name="odd_half", embedding_dim=12, num_embeddings=100, feature_names=["c"]),
        EmbeddingBagConfig(name="id_heavy", embedding_dim=16, num_embeddings=100, feature_names=["d"]),
    ]
    stats = {"wide": TableStats(pooling_factor=2.0), "id_heavy": TableStats(pooling_factor=200.0)}
    group, comm = 4, CommCosts.uniform(forward=1.0, backward=2.0)
    advice = suggest_reshape(tables, stats=stats, batch_size=BATCH, sharding_group_size=group, comm_costs=comm, min_dim=8)
    assert [a.table for a in advice] == ["wide"]
    wide = advice[0]
    assert (wide.new_rows, wide.new_dim) == (200, 8) and wide.new_rows * wide.new_dim == 100 * 16
    ids_bytes = BATCH * (group - 1) * 2.0 * comm.index_bytes
    assert wide.bytes_before == pytest.approx(BATCH * (group - 1) * 16 * 3.0 + ids_bytes)
    assert wide.bytes_after == pytest.approx(BATCH * (group - 1) * 8 * 3.0 + ids_bytes)
    assert 0 < wide.saving < 0.5


def test_apply_reshape_keeps_the_models_interface():
    torch.manual_seed(0)
    model = _model([50, 60], dim=16, device="cpu")
    batch_sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["sparse_0", "sparse_1"], values=torch.tensor([3, 49, 7, 0, 59, 12]), lengths=torch.tensor([2, 1, 1, 2])
    )
    dense = torch.randn(2, 13)
    before = model.dlrm(dense, batch_sparse)
    kept = model.dlrm.sparse_arch.embedding_bag_collection.embedding_bags["t_sparse_1"].weight.detach().clone()
    advice = suggest_reshape(embedding_tables(model), sharding_group_size=2, min_dim=8)
    advice = [a for a in advice if a.table == "t_sparse_0"]
    replaced = apply_reshape(model, advice)
    wrapper = model.dlrm.sparse_arch.embedding_bag_collection
    assert replaced == ["dlrm.sparse_arch.embedding_bag_collection"] and isinstance(wrapper, ReshapedEmbeddingBagCollection)
    inner = {c.name: c for c in wrapper.ebc.embedding_bag_configs()}
    assert (inner["t_sparse_0"].num_embeddings, inner["t_sparse_0"].embedding_dim) == (100, 8)
    assert wrapper.ebc.embedding_bags["t_sparse_0"].weight.numel() == 50 * 16
    torch.testing.assert_close(wrapper.ebc.embedding_bags["t_sparse_1"].weight, kept)
    after = model.dlrm(dense, batch_sparse)
    assert after.shape == before.shape
    out = wrapper(batch_sparse)
    assert out.length_per_key() == [16, 16]  # the projection restores the feature width
    # The projection starts as [I; I]: the half-width pooled vector, duplicated.
    half = out.to_dict()["sparse_0"]
    torch.testing.assert_close(half[:, :8], half[:, 8:])
    ids = torch.arange(50)
    rows = remap_ids(ids, "interleave")
    assert rows.unique().numel() == 50 and bool(((rows == 2 * ids) | (rows == 2 * ids + 1)).all())
    assert torch.equal(remap_ids(ids, "identity"), ids)
    # The reshaped model still plans: the inner collection's tables are what TorchRec shards.
    plan = BalancedPlanner(sharding_group_size=2, batch_size=BATCH).plan(model, _sharders())
    assert {row["table"] for row in plan_rows(plan)} == {"t_sparse_0", "t_sparse_1"}


# ----------------------------------------------------------------------------------- benchmark target
def test_balanced_plan_beats_the_default_planner_at_8_ranks():
    import planner_balance as bench  # benchmarks/planner_balance.py

    result = bench.compare(8)
    balanced, default = result["imbalance"]["balanced"], result["imbalance"]["default"]
    for metric in ("lookups", "a2a_bytes"):
        assert balanced[metric] <= bench.TARGET, (metric, balanced, default)
        assert balanced[metric] < default[metric], (metric, balanced, default)
    assert "| 8 | balanced |" in bench.markdown([result])

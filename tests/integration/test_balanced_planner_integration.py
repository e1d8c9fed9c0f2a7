"""A model planned by BalancedPlanner trains across 2 gloo processes exactly like unsharded training.

Trainer-free: ParallelTopology's mesh, make_sharders, BalancedPlanner (profiled on the oracle's
DataModule, one table hashed into partitions), shard_model and a manual SGD loop over the
oracle's global batches. Compared with the click oracle's unsharded run (lightning_recsys.testing.oracle.click). Also: a planning error
on rank 0 reaches every rank.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning_recsys.testing.oracle.click import (
    CONFIG,
    DENSE_LR,
    EMBEDDING_LR,
    STEPS,
    assert_matches,
    fit_sharded,
    make_model,
    sgd_strategy,
    shards_of,
    train_unsharded,
)
from lightning_recsys.testing.processes import run_ranks
from torchrec.distributed.planner.types import PlannerError

from lightning_recsys import EmbeddingOptimizerConfig, TableConstraints
from lightning_recsys.data import (
    SyntheticClickLog,
    SyntheticClickLogDataModule,
    slice_batch,
)
from lightning_recsys.parallel import ParallelTopology, make_sharders, shard_model
from lightning_recsys.planner import (
    BalancedPlanner,
    build_plan_report,
    make_balanced_plan,
    plan_rows,
)
from lightning_recsys.planner.config import PlanningConfig

WORLD_SIZE = 2
HASHED_TABLE, PARTITIONS = "t_sparse_1", 4  # 64 rows: 4 partitions of 16 rows, 2 per rank
# No data-parallel fallback for the other tables: their embeddings must cross the all-to-all.
CONSTRAINTS = {
    name: TableConstraints(sharding_types=["table_wise", "column_wise", "row_wise"]) for name in ("t_sparse_0", "t_sparse_2")
}


def _train_planned(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        topology = ParallelTopology(world_size=world_size, sharding_group_size=world_size)
        topology.device_mesh("cpu")
        model = make_model()
        sharders = make_sharders(EmbeddingOptimizerConfig(name="sgd", lr=EMBEDDING_LR).fused_params())
        local = CONFIG.global_batch_size // world_size
        stats = BalancedPlanner.profile(SyntheticClickLogDataModule.from_config(CONFIG), batches=STEPS)
        plan, planner = make_balanced_plan(
            model,
            sharders,
            sharding_group_size=world_size,
            group_ranks_per_node=world_size,
            compute_device="cpu",
            constraints=CONSTRAINTS,
            batch_size=local,
            stats=stats,
            hash_partitions={HASHED_TABLE: PARTITIONS},
        )
        report = build_plan_report(
            plan, model, sharders, sharding_group_size=world_size, batch_size=local, stats=stats,
            table_constraints=CONSTRAINTS, hash_partitions={HASHED_TABLE: PARTITIONS},
        )  # fmt: skip
        sharded = shard_model(model, topology=topology, device=torch.device("cpu"), sharders=sharders, plan=plan)
        dense = [p for p in sharded.dmp.parameters() if not sharded.is_embedding_param(p)]
        optimizers = [torch.optim.SGD(dense, lr=DENSE_LR)]
        if sharded.data_parallel_table_params:
            optimizers.append(torch.optim.SGD(sharded.data_parallel_table_params, lr=EMBEDDING_LR))
        log = SyntheticClickLog(CONFIG)
        for step in range(STEPS):
            batch = slice_batch(log.global_batch("train", step), rank * local, (rank + 1) * local)
            for optimizer in optimizers:
                optimizer.zero_grad()
            F.binary_cross_entropy_with_logits(sharded.dmp(batch), batch.labels).backward()
            for optimizer in optimizers:
                optimizer.step()
        model.eval()
        with torch.no_grad():
            predictions = model(slice_batch(log.global_batch("val", 0), rank * local, (rank + 1) * local))
        hashed = plan.plan["dlrm.sparse_arch.embedding_bag_collection"][HASHED_TABLE]
        # A plan that cannot fit fails on every rank with rank 0's error instead of leaving rank 1 waiting.
        try:
            BalancedPlanner(sharding_group_size=world_size, batch_size=local, memory_per_rank=512).collective_plan(
                make_model(), sharders
            )
            planning_error = ""
        except PlannerError as err:
            planning_error = str(err)
        return {
            "shards": shards_of(model),
            "predictions": predictions,
            "plan": plan_rows(plan),
            "hashed_shards": [(m.shard_offsets[0], m.shard_sizes[0]) for m in hashed.sharding_spec.shards],
            "planned_here": planner.last_result is not None,
            "report_ranks": len(report.ranks),
            "planning_error": planning_error,
        }
    finally:
        dist.destroy_process_group()


def test_balanced_plan_trains_like_unsharded() -> None:
    expected_state, expected_predictions = train_unsharded()
    results = run_ranks(_train_planned, WORLD_SIZE, timeout=120)

    assert [r["planned_here"] for r in results] == [True, False]  # rank 0 planned, rank 1 got the broadcast
    assert results[0]["plan"] == results[1]["plan"]
    by_table = {row["table"]: row for row in results[0]["plan"]}
    assert by_table[HASHED_TABLE]["sharding_type"] == "row_wise"
    partition_rows = CONFIG.table_sizes[1] // PARTITIONS
    assert all(offset % partition_rows == 0 and size == partition_rows * PARTITIONS // WORLD_SIZE for offset, size in results[0]["hashed_shards"])
    assert all(by_table[name]["sharding_type"] != "data_parallel" for name in CONSTRAINTS)
    assert all(r["report_ranks"] == WORLD_SIZE for r in results)
    assert results[0]["planning_error"] == results[1]["planning_error"] and "needs at least" in results[0]["planning_error"]
    assert_matches([r["shards"] for r in results], [r["predictions"] for r in results], expected_state, expected_predictions)


def _fit_with_balanced_strategy(rank: int, world_size: int) -> dict:
    strategy = sgd_strategy(
        planning=PlanningConfig(
            planner="balanced", profile_batches=STEPS, hash_partitions={HASHED_TABLE: PARTITIONS}, table_constraints=CONSTRAINTS
        )
    )
    model, _, predictions = fit_sharded(rank, world_size, strategy)
    report = strategy.plan_report.to_json() if strategy.plan_report is not None else None
    return {"shards": shards_of(model), "predictions": predictions, "plan": plan_rows(strategy.sharded_model.plan), "report": report}


def test_strategy_with_the_balanced_planner_matches_unsharded():
    expected_state, expected_predictions = train_unsharded()
    results = run_ranks(_fit_with_balanced_strategy, WORLD_SIZE, timeout=240)
    assert_matches([r["shards"] for r in results], [r["predictions"] for r in results], expected_state, expected_predictions)
    hashed = next(row for row in results[0]["plan"] if row["table"] == HASHED_TABLE)
    assert hashed["sharding_type"] == "row_wise"
    assert results[0]["report"] is not None and results[1]["report"] is None  # reported on rank 0

"""Tables the planner makes data-parallel, in 1D and 2D (4 processes as 2 nodes x 2 ranks, gloo).

TorchRec's planner plans small tables ``data_parallel`` when every sharding type is allowed (the
default). Under 2D they are DDP parameters over the whole world, so they must be equal on every rank,
whatever each rank's RNG state was when the model was built.
"""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch import Trainer
from lightning_recsys.testing.oracle.click import sgd_strategy
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys.callbacks import RunSummary, format_summary
from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import DLRMRanker
from lightning_recsys.parallel.sharding.sharded_model import local_shards
from lightning_recsys.planner import plan_rows

WORLD_SIZE, NODES, PER_NODE = 4, 2, 2
TABLE_SIZES = [5000, 30, 20, 10]  # the planner makes the three small ones data_parallel
CONFIG = SyntheticClickLogConfig(
    table_sizes=TABLE_SIZES, num_dense_features=4, global_batch_size=32, train_batches=3, val_batches=1, seed=3
)


def _fit_default_allow_list(rank: int, world_size: int, embedding_device: str | None, sharding_group_size: int) -> dict:
    torch.manual_seed(100 + rank)  # ranks seeded differently: data-parallel tables must still agree
    model = DLRMRanker(
        table_sizes=TABLE_SIZES, num_dense_features=4, embedding_dim=8, dense_arch_layer_sizes=[8, 8],
        over_arch_layer_sizes=[8, 1], dense_optimizer="sgd", dense_lr=0.1, embedding_device=embedding_device,
    )
    strategy = sgd_strategy(sharding_group_size=sharding_group_size)
    trainer = Trainer(
        accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=strategy, max_steps=3, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    sharding = {row["table"]: row["sharding_type"] for row in plan_rows(strategy.sharded_model.plan)}
    return {"sharding": sharding, "shards": {k: [(o, t.clone()) for o, t in v] for k, v in local_shards(model.dlrm).items()}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding_group_size", "embedding_device"),
    # meta: TorchRec initializes the tables (the 2D crash); None: our copy of initial values, ranks seeded apart.
    [(PER_NODE, "meta"), (PER_NODE, None), (WORLD_SIZE, None)],
    ids=["2d-meta", "2d-initial-values", "1d-initial-values"],
)
def test_data_parallel_tables_train_and_stay_equal_on_every_rank(sharding_group_size, embedding_device):
    results = run_ranks(
        _fit_default_allow_list, WORLD_SIZE, embedding_device, sharding_group_size, timeout=240, ranks_per_node=PER_NODE
    )
    sharding = results[0]["sharding"]
    data_parallel = [t for t, s in sharding.items() if s == "data_parallel"]
    assert data_parallel, f"the planner made no table data_parallel: {sharding}"
    for table in data_parallel:
        key = next(k for k in results[0]["shards"] if f".{table}." in k)
        first = results[0]["shards"][key][0][1]
        for rank, result in enumerate(results[1:], start=1):
            assert torch.equal(result["shards"][key][0][1], first), f"data-parallel {table} differs on rank {rank}"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fit_every_table_data_parallel(rank: int, world_size: int) -> dict:
    lines = _Lines()
    logging.getLogger("lightning.pytorch").addHandler(lines)  # rank_zero_info's logger is a child of it
    model = DLRMRanker(
        table_sizes=TABLE_SIZES, num_dense_features=4, embedding_dim=8, dense_arch_layer_sizes=[8, 8],
        over_arch_layer_sizes=[8, 1], dense_optimizer="sgd", dense_lr=0.1,
    )
    strategy = sgd_strategy(sharding_group_size=PER_NODE, sharding_types=["data_parallel"])
    summary = RunSummary(warmup_steps=0)
    trainer = Trainer(
        accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=strategy, max_steps=3, limit_val_batches=1,
        val_check_interval=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[summary],
    )
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    strategy.sync_replicas()  # a forced sync: nothing to do, no collective
    return {
        "sharding": {row["table"]: row["sharding_type"] for row in plan_rows(strategy.sharded_model.plan)},
        "synchronizer": strategy.runtime.replica_sync is not None,
        "totals": strategy.runtime.sync_totals,
        "stats": strategy.replica_sync_stats,
        "summary": summary.summary,
        "table": format_summary(summary.summary),
        "nothing_to_sync": [line for line in lines.lines if "nothing to sync" in line],
        "shards": {k: [(o, t.clone()) for o, t in v] for k, v in local_shards(model.dlrm).items()},
    }


@pytest.mark.slow
def test_2d_with_every_table_data_parallel_skips_the_replica_sync():
    """Nothing model-parallel: the replica sync ran empty syncs every step and the summary said "0 of 0 rows"."""
    results = run_ranks(_fit_every_table_data_parallel, WORLD_SIZE, timeout=240, ranks_per_node=PER_NODE)
    assert set(results[0]["sharding"].values()) == {"data_parallel"}, results[0]["sharding"]
    for rank, result in enumerate(results):
        assert not result["synchronizer"] and result["totals"] is None and result["stats"] is None, rank
        assert "replica_sync" not in result["summary"]["bytes_per_step_by_purpose"], rank
        assert result["summary"]["replica_sync"] is None, rank
        assert "0 of 0" not in result["table"] and "rows per sync" not in result["table"], rank
        assert result["shards"] == {} or all(torch.equal(t, results[0]["shards"][k][i][1])
                                             for k, v in result["shards"].items() for i, (_, t) in enumerate(v))
    assert "replica syncs" in results[0]["table"] and "none" in results[0]["table"]
    assert len(results[0]["nothing_to_sync"]) == 1, results[0]["nothing_to_sync"]
    assert all(not r["nothing_to_sync"] for r in results[1:])

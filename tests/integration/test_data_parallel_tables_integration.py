"""Tables the planner makes data-parallel, in 1D and 2D (4 processes as 2 nodes x 2 ranks, gloo).

TorchRec's planner plans small tables ``data_parallel`` when every sharding type is allowed (the
default). Under 2D they are DDP parameters over the whole world, so they must be equal on every rank,
whatever each rank's RNG state was when the model was built.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from multiprocess import run_ranks
from oracle import sgd_strategy

from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import DLRMRanker
from lightning_recsys.parallel.sharded_model import local_shards
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
    trainer.fit(model, datamodule=SyntheticClickLogDataModule(CONFIG))
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

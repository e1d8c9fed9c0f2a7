"""The click oracle: a tiny ``DLRMRanker`` on a synthetic click log (``lightning_recsys.data.SyntheticClickLog``),
whose global batch ``i`` is the same for any number of ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_recsys.data import RecBatch, SyntheticClickLog, SyntheticClickLogConfig, SyntheticClickLogDataModule, slice_batch
from lightning_recsys.models import DLRMRanker
from lightning_recsys.testing.oracle.core import Oracle

STEPS = 3
EMBEDDING_LR, DENSE_LR = 0.3, 0.1
DIM = 8
CONFIG = SyntheticClickLogConfig(
    table_sizes=[40, 64, 24],
    num_dense_features=4,
    pooling_factors=[2.0, 3.0, 1.0],
    global_batch_size=16,
    train_batches=STEPS,
    val_batches=1,
    seed=7,
)
TABLES = tuple(f"t_sparse_{i}" for i in range(len(CONFIG.table_sizes)))
TABLE_KEY = "dlrm.sparse_arch.embedding_bag_collection.embedding_bags.t_sparse_0.weight"


def make_model(embedding_device: str | None = None, seed: int | None = 1234, *, cls: type[DLRMRanker] = DLRMRanker, **overrides: object) -> DLRMRanker:
    if seed is not None:
        torch.manual_seed(seed)
    arguments = dict(
        table_sizes=CONFIG.table_sizes, num_dense_features=CONFIG.num_dense_features, embedding_dim=DIM, dense_arch_layer_sizes=[8, 8],
        over_arch_layer_sizes=[8, 1], dense_optimizer="sgd", dense_lr=DENSE_LR, embedding_device=embedding_device,
    )  # fmt: skip
    return cls(**{**arguments, **overrides})  # type: ignore[arg-type]


def is_table(key: str) -> bool:
    return "embedding_bags" in key


def global_batch(config: SyntheticClickLogConfig, split: str, index: int) -> RecBatch:
    return SyntheticClickLog(config).global_batch(split, index)  # type: ignore[arg-type]


def rank_batch(config: SyntheticClickLogConfig, split: str, index: int, rank: int, world_size: int) -> RecBatch:
    batch = global_batch(config, split, index)
    if world_size == 1:
        return batch
    local = config.global_batch_size // world_size
    return slice_batch(batch, rank * local, (rank + 1) * local)


def _loss(model: DLRMRanker, batch: RecBatch) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(batch), batch.labels)


ORACLE = Oracle(
    make_model=make_model, config=CONFIG, datamodule=SyntheticClickLogDataModule.from_config, rank_batch=rank_batch, loss=_loss,
    is_table=is_table, compared=lambda key: True, tables=TABLES, dim=DIM, table_key=TABLE_KEY, steps=STEPS,
    embedding_lr=EMBEDDING_LR, dense_lr=DENSE_LR,
)  # fmt: skip
train_unsharded = ORACLE.train_unsharded
fit_sharded = ORACLE.fit_sharded
local_predictions = ORACLE.local_predictions
sgd_strategy = ORACLE.sgd_strategy
shards_of = ORACLE.shards_of
table_shards = ORACLE.table_shards
assert_matches = ORACLE.assert_matches

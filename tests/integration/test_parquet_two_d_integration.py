"""SequenceParquetDataModule under 2D (4 processes as 2 nodes x 2, gloo): a short fit whose validation ranks every
user once over the 4 ranks, then predict writes 4 shards holding every user once."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from lightning.pytorch import Callback, Trainer

from lightning_recsys import EmbeddingOptimizerConfig, PlanningConfig, ReplicaSyncConfig, TwoDRecStrategy
from lightning_recsys.data.parquet import PreparedWriter, SequenceParquetDataModule, UserEmbeddingWriter
from lightning_recsys.models import SequencePretrainer
from lightning_recsys.testing.processes import run_ranks

WORLD, PER_NODE, NODES = 4, 2, 2
NUM_ITEMS, GROUP_SIZES = 30, (37, 41, 29)

pytestmark = pytest.mark.slow


class _ValUsers(Callback):
    def __init__(self) -> None:
        self.users: list[list[int]] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.users.append(batch.user_ids.tolist())


def _trainer(callbacks: list, **kwargs) -> Trainer:
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=0.1), sharding_group_size=PER_NODE,
        replica_sync=ReplicaSyncConfig(rows="touched"), planning=PlanningConfig(sharding_types=["row_wise"]), process_group_timeout=60,
    )
    options = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False)
    return Trainer(accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=strategy, callbacks=callbacks, **{**options, **kwargs})


def _fit_and_predict(rank: int, world_size: int, root: str) -> list[list[int]]:
    import torch

    def data() -> SequenceParquetDataModule:
        return SequenceParquetDataModule(os.path.join(root, "prepared"), max_length=5, num_negatives=4, global_batch_size=8)

    torch.manual_seed(0)
    model = SequencePretrainer(num_items=NUM_ITEMS, embedding_dim=8, max_length=5, num_layers=1, num_heads=1, dropout=0.0)
    record = _ValUsers()
    _trainer([record], max_epochs=1).fit(model, datamodule=data())
    _trainer([UserEmbeddingWriter(os.path.join(root, "embeddings"))]).predict(model, datamodule=data(), return_predictions=False)
    return record.users


def test_validation_and_predict_cover_every_user_once_under_2d(tmp_path):
    rng = np.random.default_rng(9)
    writer = PreparedWriter(tmp_path / "prepared", NUM_ITEMS, groups_per_file=2)
    lengths_all, first = [], 0
    for size in GROUP_SIZES:
        lengths = rng.choice([1, 2, 3, 5, 8], size=size)
        writer.write_group(np.arange(first, first + size), lengths, rng.integers(0, NUM_ITEMS, size=int(lengths.sum())))
        lengths_all.append(lengths)
        first += size
    writer.close()
    results = run_ranks(_fit_and_predict, WORLD, str(tmp_path), timeout=400, ranks_per_node=PER_NODE)
    lengths = np.concatenate(lengths_all)
    assert len({len(r) for r in results}) == 1 and all(batch for r in results for batch in r)
    assert sorted(u for r in results for batch in r for u in batch) == np.flatnonzero(lengths >= 3).tolist()
    shards = sorted((tmp_path / "embeddings").glob("*.parquet"))
    assert len(shards) == WORLD
    assert sorted(u for s in shards for u in pq.read_table(s, columns=["user_id"]).column(0).to_pylist()) == list(range(first))

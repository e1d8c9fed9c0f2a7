"""The sequence oracle: a tiny ``SequenceRanker`` on hand-made sequence batches.

The batches follow the sequence contract (history item ids oldest first, one action per history
item, one candidate, pooled context features, dense features) and, like the synthetic click logs,
do not depend on the number of ranks: global batch ``i`` is the same on 1 or 4 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset
from torchrec import KeyedJaggedTensor

from lightning_recsys.data import RecBatch, slice_batch
from lightning_recsys.data.module import RankSlicedDataModule
from lightning_recsys.models import SequenceRanker
from lightning_recsys.testing.oracle.core import Oracle

STEPS = 3
EMBEDDING_LR, DENSE_LR = 0.3, 0.1
ITEMS, ACTIONS, CONTEXT = 48, 4, {"user_id": 20, "genre": 12}
DIM, NUM_DENSE, MAX_HISTORY = 8, 3, 6
TABLES = ("item", "action", "t_user_id", "t_genre")
ITEM_KEY = "sequence_embeddings.embeddings.item.weight"
ACTION_KEY = "sequence_embeddings.embeddings.action.weight"


@dataclass(frozen=True)
class SequenceLogConfig:
    global_batch_size: int = 16
    train_batches: int = STEPS
    val_batches: int = 1
    test_batches: int = 1
    max_length: int = 9  # longer than MAX_HISTORY: the cut is exercised sharded too
    seed: int = 5
    with_context: bool = True  # False: the sequence features only (for a model without context tables)


CONFIG = SequenceLogConfig()


def global_batch(config: SequenceLogConfig, split: str, index: int) -> RecBatch:
    """Global batch ``index`` of ``split``: some empty histories, some longer than the model keeps."""
    generator = torch.Generator().manual_seed(config.seed * 1000 + {"train": 0, "val": 1, "test": 2}[split] * 100 + index)
    size = config.global_batch_size
    history_lengths = torch.randint(0, config.max_length + 1, (size,), generator=generator)
    total = int(history_lengths.sum())
    context = CONTEXT if config.with_context else {}
    context_lengths = {name: torch.randint(1, 3, (size,), generator=generator) for name in context}
    values = [
        torch.randint(0, ITEMS, (total,), generator=generator),
        torch.randint(0, ACTIONS, (total,), generator=generator),
        torch.randint(0, ITEMS, (size,), generator=generator),
        *(torch.randint(0, rows, (int(context_lengths[name].sum()),), generator=generator) for name, rows in context.items()),
    ]
    lengths = [history_lengths, history_lengths, torch.ones(size, dtype=torch.long), *context_lengths.values()]
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=["history_item_id", "history_action", "candidate_item_id", *context], values=torch.cat(values), lengths=torch.cat(lengths)
    )
    dense = torch.rand(size, NUM_DENSE, generator=generator)
    labels = torch.randint(0, 2, (size,), generator=generator).float()
    return RecBatch(dense=dense, sparse=sparse, labels=labels)


def rank_batch(config: SequenceLogConfig, split: str, index: int, rank: int, world_size: int) -> RecBatch:
    batch = global_batch(config, split, index)
    if world_size == 1:
        return batch
    local = config.global_batch_size // world_size
    return slice_batch(batch, rank * local, (rank + 1) * local)


class _SequenceSlices(IterableDataset):
    def __init__(self, config: SequenceLogConfig, split: str, num_batches: int, rank: int, world_size: int) -> None:
        local = config.global_batch_size // world_size
        self.config, self.split, self.num_batches, self.start, self.stop = config, split, num_batches, rank * local, (rank + 1) * local

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):  # type: ignore[no-untyped-def]
        for index in range(self.num_batches):
            yield slice_batch(global_batch(self.config, self.split, index), self.start, self.stop)


class SequenceDataModule(RankSlicedDataModule):
    """This rank's slice of every global batch of ``config``."""

    def __init__(self, config: SequenceLogConfig | None = None) -> None:
        super().__init__()
        self.config = config or CONFIG

    def _dataset(self, split: str, rank: int, world_size: int) -> _SequenceSlices:  # type: ignore[override]
        batches = {"train": self.config.train_batches, "val": self.config.val_batches, "test": self.config.test_batches}[split]
        return _SequenceSlices(self.config, split, batches, rank, world_size)


def make_model(
    embedding_device: str | None = None, seed: int | None = 1234, *, cls: type[SequenceRanker] = SequenceRanker, **overrides: object
) -> SequenceRanker:
    if seed is not None:
        torch.manual_seed(seed)
    arguments = dict(
        item_table_size=ITEMS, num_action_types=ACTIONS, context_feature_names=list(CONTEXT), context_table_sizes=list(CONTEXT.values()),
        num_dense_features=NUM_DENSE, embedding_dim=DIM, max_history=MAX_HISTORY, num_layers=1, num_heads=2, feedforward_dim=16,
        dropout=0.0, newest_tokens=2, over_arch_layer_sizes=[8, 1], dense_optimizer="sgd", dense_lr=DENSE_LR, embedding_device=embedding_device,
        # The superset of the forward paths (the "concat" model plus the action means, the dots and the
        # action-prediction loss): every sharded test (TW/RW/CW, QComms, 2D, DCP, the pipeline) then
        # covers them. history_dropout (random per rank) is left out: the CLI test trains the shipped
        # config with it.
        interaction="dot", action_means=True, action_loss_weight=0.5, positive_actions=[2, 3],
    )  # fmt: skip
    return cls(**{**arguments, **overrides})  # type: ignore[arg-type]


def is_table(key: str) -> bool:
    return "sequence_embeddings.embeddings." in key or "context_embeddings.embedding_bags." in key


def _loss(model: SequenceRanker, batch: RecBatch) -> torch.Tensor:
    return model.training_losses(batch)["loss"]  # the click loss and the action-prediction loss


ORACLE = Oracle(
    make_model=make_model, config=CONFIG, datamodule=SequenceDataModule, rank_batch=rank_batch, loss=_loss, is_table=is_table,
    compared=lambda key: is_table(key) or "metrics" not in key, tables=TABLES, dim=DIM, table_key=ITEM_KEY, steps=STEPS,
    embedding_lr=EMBEDDING_LR, dense_lr=DENSE_LR,
)  # fmt: skip
train_unsharded = ORACLE.train_unsharded
fit_sharded = ORACLE.fit_sharded
local_predictions = ORACLE.local_predictions
sgd_strategy = ORACLE.sgd_strategy
shards_of = ORACLE.shards_of
table_shards = ORACLE.table_shards
assert_matches = ORACLE.assert_matches

"""The correctness oracle for SequenceRanker: tiny sequence batches, unsharded SGD training, and sharded fits.

The batches follow the sequence contract (history item ids oldest first, one action per history
item, one candidate, pooled context features, dense features) and, like the synthetic click logs,
do not depend on the number of ranks: global batch ``i`` is the same on 1 or 4 ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import IterableDataset

from lightning_recsys import EmbeddingOptimizerConfig, GuardConfig, PlanningConfig, TableConstraints, TwoDRecStrategy
from lightning_recsys.data import RecBatch, slice_batch
from lightning_recsys.data.module import RankSlicedDataModule
from lightning_recsys.models import SequenceRanker
from lightning_recsys.parallel.sharding.sharded_model import local_shards
from torchrec import KeyedJaggedTensor

STEPS = 3
EMBEDDING_LR, DENSE_LR = 0.3, 0.1
ITEMS, ACTIONS, CONTEXT = 48, 4, {"user_id": 20, "genre": 12}
DIM, NUM_DENSE, MAX_HISTORY = 8, 3, 6
TABLES = ["item", "action", "t_user_id", "t_genre"]
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


class _SequenceSlices(IterableDataset):
    def __init__(self, config: SequenceLogConfig, split: str, num_batches: int, rank: int, world_size: int) -> None:
        local = config.global_batch_size // world_size
        self.config, self.split, self.num_batches, self.start, self.stop = config, split, num_batches, rank * local, (rank + 1) * local

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        for index in range(self.num_batches):
            yield slice_batch(global_batch(self.config, self.split, index), self.start, self.stop)


class SequenceDataModule(RankSlicedDataModule):
    """This rank's slice of every global batch of ``config``."""

    def __init__(self, config: SequenceLogConfig | None = None) -> None:
        super().__init__()
        self.config = config or SequenceLogConfig()

    def _dataset(self, split: str, rank: int, world_size: int) -> _SequenceSlices:
        batches = {"train": self.config.train_batches, "val": self.config.val_batches, "test": self.config.test_batches}[split]
        return _SequenceSlices(self.config, split, batches, rank, world_size)


def make_model(embedding_device: str | None = None, seed: int | None = 1234, **overrides: object) -> SequenceRanker:
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
    )
    return SequenceRanker(**{**arguments, **overrides})  # type: ignore[arg-type]


def is_table(name: str) -> bool:
    return "sequence_embeddings.embeddings." in name or "context_embeddings.embedding_bags." in name


def train_unsharded(
    config: SequenceLogConfig | None = None, steps: int = STEPS, **model_overrides: object
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Plain SGD on the whole global batches: the state dict and the validation predictions."""
    config = config or SequenceLogConfig()
    model = make_model(**model_overrides)
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD([
        {"params": [p for n, p in params.items() if not is_table(n)], "lr": DENSE_LR},
        {"params": [p for n, p in params.items() if is_table(n)], "lr": EMBEDDING_LR},
    ])
    for step in range(steps):
        batch = global_batch(config, "train", step)
        optimizer.zero_grad()
        model.training_losses(batch)["loss"].backward()  # the click loss and the action-prediction loss
        optimizer.step()
    model.eval()
    with torch.no_grad():
        predictions = model(global_batch(config, "val", 0))
    return {k: v.clone() for k, v in model.state_dict().items() if is_table(k) or "metrics" not in k}, predictions


def sgd_strategy(*, sharding_types: list[str] | None = None, column_width: int = DIM // 2, **kwargs: object) -> TwoDRecStrategy:
    """SGD tables; column_wise cuts each table into ``column_width``-wide shards (TorchRec's default
    min_partition keeps a small table whole)."""
    kwargs.setdefault("process_group_timeout", 60)
    constraints = {}
    if sharding_types == ["column_wise"]:
        constraints = {t: TableConstraints(sharding_types=sharding_types, min_partition=column_width) for t in TABLES}
    kwargs.setdefault("planning", PlanningConfig(sharding_types=sharding_types, table_constraints=constraints))
    kwargs.setdefault("guard", GuardConfig(validate_inputs="error", check_finite=False))
    return TwoDRecStrategy(embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=EMBEDDING_LR), **kwargs)


def fit_sharded(
    rank: int, world_size: int, strategy: TwoDRecStrategy, *, devices: int | None = None, num_nodes: int = 1,
    config: SequenceLogConfig | None = None, callbacks: list[Callback] | None = None, steps: int = STEPS,
    model_factory: Callable[[], SequenceRanker] = make_model, accelerator: str = "cpu",
) -> tuple[SequenceRanker, Trainer, torch.Tensor]:
    """Fit the oracle's model with ``strategy``; return it, the trainer and this rank's validation predictions."""
    config = config or SequenceLogConfig()
    model = model_factory()
    trainer = Trainer(
        accelerator=accelerator, devices=devices or world_size, num_nodes=num_nodes, strategy=strategy, max_steps=steps,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=SequenceDataModule(config))
    return model, trainer, local_predictions(model, rank, world_size, config)


def local_predictions(model: SequenceRanker, rank: int, world_size: int, config: SequenceLogConfig | None = None) -> torch.Tensor:
    config = config or SequenceLogConfig()
    local = config.global_batch_size // world_size
    model.eval()
    device = next(model.over_arch.parameters()).device
    with torch.no_grad():
        return model(slice_batch(global_batch(config, "val", 0), rank * local, (rank + 1) * local).to(device)).cpu()


def table_shards(model: SequenceRanker) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    return {k: [(o, t.cpu()) for o, t in v] for k, v in local_shards(model).items() if is_table(k)}

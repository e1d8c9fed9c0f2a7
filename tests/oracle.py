"""The correctness oracle: one tiny DLRM trained unsharded in one process on the global batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback

from lightning_recsys import EmbeddingOptimizerConfig, GuardConfig, PlanningConfig, TableConstraints, TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogConfig, SyntheticClickLogDataModule, slice_batch
from lightning_recsys.models import DLRMRanker
from lightning_recsys.parallel.sharding.sharded_model import local_shards

STEPS = 3
EMBEDDING_LR = 0.3
DENSE_LR = 0.1
TABLE_KEY = "sparse_arch.embedding_bag_collection.embedding_bags.t_sparse_0.weight"
CONFIG = SyntheticClickLogConfig(
    table_sizes=[40, 64, 24],
    num_dense_features=4,
    pooling_factors=[2.0, 3.0, 1.0],
    global_batch_size=16,
    train_batches=STEPS,
    val_batches=1,
    seed=7,
)

Shards = dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]


def make_model(embedding_device: str | None = None, seed: int | None = 1234, cls: type[DLRMRanker] = DLRMRanker) -> DLRMRanker:
    if seed is not None:
        torch.manual_seed(seed)
    return cls(
        table_sizes=CONFIG.table_sizes,
        num_dense_features=CONFIG.num_dense_features,
        embedding_dim=8,
        dense_arch_layer_sizes=[8, 8],
        over_arch_layer_sizes=[8, 1],
        dense_optimizer="sgd",
        dense_lr=DENSE_LR,
        embedding_device=embedding_device,
    )


def train_unsharded(steps: int = STEPS) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Plain SGD on the whole global batch: the state dict and the validation predictions."""
    return train_plain_sgd(make_model(), CONFIG, steps, dense_lr=DENSE_LR, embedding_lr=EMBEDDING_LR)


def train_plain_sgd(
    model: torch.nn.Module, config: SyntheticClickLogConfig, steps: int, *, dense_lr: float, embedding_lr: float
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``model`` (EmbeddingBagCollection tables) trained unsharded with SGD on ``config``'s global batches."""
    embedding = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    optimizer = torch.optim.SGD([{"params": dense, "lr": dense_lr}, {"params": embedding, "lr": embedding_lr}])
    log = SyntheticClickLog(config)
    for step in range(steps):
        batch = log.global_batch("train", step)
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(model(batch), batch.labels).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        predictions = model(log.global_batch("val", 0))
    return {k: v.clone() for k, v in model.state_dict().items()}, predictions


def fit_sharded(
    rank: int,
    world_size: int,
    strategy: TwoDRecStrategy,
    *,
    accelerator: str = "cpu",
    devices: int | None = None,
    num_nodes: int = 1,
    callbacks: list[Callback] | None = None,
    embedding_device: str | None = None,
    model_class: type[DLRMRanker] = DLRMRanker,
) -> tuple[DLRMRanker, Trainer, torch.Tensor]:
    """Fit the oracle's model with ``strategy``; return it, the trainer and this rank's validation predictions.

    ``embedding_device="meta"`` leaves table initialization to TorchRec, with this rank's RNG state.
    """
    model = make_model(embedding_device, seed=None if embedding_device == "meta" else 1234, cls=model_class)
    trainer = Trainer(
        accelerator=accelerator,
        devices=devices or world_size,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=SyntheticClickLogDataModule(CONFIG))
    local = CONFIG.global_batch_size // world_size
    model.eval()
    with torch.no_grad():
        eval_batch = slice_batch(SyntheticClickLog(CONFIG).global_batch("val", 0), rank * local, (rank + 1) * local)
        predictions = model(eval_batch.to(strategy.root_device)).cpu()
    return model, trainer, predictions


def sgd_strategy(
    *, sharding_types: list[str] | None = None, validate_inputs: str = "error", check_finite: bool = False, **kwargs: object
) -> TwoDRecStrategy:
    """The oracle's strategy (SGD tables); the planner allow-list and guard settings are spelled flat for brevity."""
    kwargs.setdefault("process_group_timeout", 60)
    constraints = {}
    if sharding_types in (["column_wise"], ["table_column_wise"]):
        # TorchRec's default min_partition keeps a dim-8 table in one column shard: split it in two.
        constraints = {f"t_sparse_{i}": TableConstraints(sharding_types=sharding_types, min_partition=4) for i in range(len(CONFIG.table_sizes))}
    kwargs.setdefault("planning", PlanningConfig(sharding_types=sharding_types, table_constraints=constraints))
    return TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=EMBEDDING_LR),
        guard=GuardConfig(validate_inputs=validate_inputs, check_finite=check_finite),  # type: ignore[arg-type]
        **kwargs,
    )


def shards_of(model: DLRMRanker) -> Shards:
    return {k: [(o, t.cpu()) for o, t in v] for k, v in local_shards(model.dlrm).items()}


def assemble(pieces_by_rank: list[Shards], key: str, like: torch.Tensor) -> torch.Tensor:
    """The full tensor ``key`` put together from the ranks' pieces; fails if they leave a gap."""
    full = torch.full_like(like, float("nan"))
    for pieces in pieces_by_rank:
        for offsets, tensor in pieces[key]:
            full[tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))] = tensor
    assert not torch.isnan(full).any(), f"{key}: the ranks' shards do not cover the whole table"
    return full


def assert_matches(shards: list[Shards], predictions: list[torch.Tensor], expected_state, expected_predictions, **tol) -> None:
    """The ranks' shards assemble to the oracle's weights and their predictions concatenate to its predictions."""
    for key, expected in expected_state.items():
        local_key = key.removeprefix("dlrm.")
        assembled = assemble(shards, local_key, expected)
        torch.testing.assert_close(assembled, expected, msg=lambda m: f"{key}: {m}", **tol)
    torch.testing.assert_close(torch.cat(predictions), expected_predictions, **tol)
    # Training must have moved the tables, or the comparison above proves nothing.
    assert not torch.allclose(make_model().state_dict()["dlrm." + TABLE_KEY], expected_state["dlrm." + TABLE_KEY])


class RecordPipeline(Callback):
    """What the sparse-dist pipeline did while training (the strategy drops it at teardown)."""

    def __init__(self) -> None:
        self.pipelined: set[str] = set()
        self.disabled_reason: str | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pipeline = trainer.strategy._input_pipeline
        if pipeline is not None:
            self.pipelined |= set(pipeline.pipelined_modules)
            self.disabled_reason = pipeline.disabled_reason

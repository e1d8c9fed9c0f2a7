"""The oracle's workload-independent part: one ``Oracle`` that trains a tiny model unsharded with plain SGD in
one process (the reference) and fits the same model sharded under ``TwoDRecStrategy`` (what is compared).

A workload (``click``, ``sequence``, ``pretrain``) gives its model, its data and its loss; everything else is
here once: the SGD parameter groups (table rows at ``embedding_lr``, the dense part at ``dense_lr``), the
Trainer a sharded fit runs, the SGD strategy, this rank's shards and their assembly, and the comparison.
The reference itself makes no process-group call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer

from lightning_recsys import EmbeddingOptimizerConfig, GuardConfig, PlanningConfig, TableConstraints, TwoDRecStrategy
from lightning_recsys.parallel.sharding.sharded_model import local_shards

# State-dict key -> this rank's pieces of that tensor: [(offsets, tensor)] (a replicated tensor is one whole piece).
Shards = dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]


class Expected(NamedTuple):
    """What the unsharded reference ends with: its state dict and its predictions on validation batch 0."""

    state: dict[str, torch.Tensor]
    predictions: torch.Tensor


class Fitted(NamedTuple):
    """A sharded fit: the model, its Trainer and this rank's predictions on its slice of validation batch 0."""

    model: Any
    trainer: Trainer
    predictions: torch.Tensor


def assemble(pieces_by_rank: Sequence[Shards], key: str, like: torch.Tensor) -> torch.Tensor:
    """The full tensor ``key`` put together from the ranks' pieces; fails if they leave a gap."""
    full = torch.full_like(like, float("nan"))
    for pieces in pieces_by_rank:
        for offsets, tensor in pieces[key]:
            full[tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))] = tensor
    assert not torch.isnan(full).any(), f"{key}: the ranks' shards do not cover the whole table"
    return full


class RecordPipeline(Callback):
    """What the sparse-dist pipeline did while training (the strategy drops it at teardown)."""

    def __init__(self) -> None:
        self.pipelined: set[str] = set()
        self.disabled_reason: str | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        pipeline = trainer.strategy._input_pipeline
        if pipeline is not None:
            self.pipelined |= set(pipeline.pipelined_modules)
            self.disabled_reason = pipeline.disabled_reason


@dataclass(frozen=True)
class Oracle:
    """One workload's reference and sharded fit. A workload module binds these methods to module names
    (``train_unsharded = ORACLE.train_unsharded``...), so every workload has the same API.

    Args:
        make_model: ``make_model(embedding_device=None, seed=1234, **overrides)``, the workload's model.
        config: the default data config (``CONFIG``).
        datamodule: the DataModule that gives each rank its slice of every global batch of a config.
        rank_batch: ``rank_batch(config, split, index, rank, world_size)``: rank ``rank``'s slice of global
            batch ``index`` (``world_size=1``: the whole global batch).
        loss: the training loss of a model on a batch (what ``training_step`` minimizes).
        is_table: whether a state-dict key is an embedding table's (trained at ``embedding_lr``).
        compared: whether a state-dict key is part of the reference's state (and of ``shards_of``).
        tables: the table names (``sgd_strategy``'s column-wise constraints name them).
        dim: the tables' embedding dimension (column-wise cuts it in two by default).
        table_key: a table that training must move (``assert_matches`` checks that it did).
    """

    make_model: Callable[..., LightningModule]
    config: Any
    datamodule: Callable[[Any], LightningDataModule]
    rank_batch: Callable[[Any, str, int, int, int], Any]
    loss: Callable[[Any, Any], torch.Tensor]
    is_table: Callable[[str], bool]
    compared: Callable[[str], bool]
    tables: tuple[str, ...]
    dim: int
    table_key: str
    steps: int
    embedding_lr: float
    dense_lr: float

    def train_unsharded(
        self, world_size: int = 1, *, model: Any = None, config: Any = None, steps: int | None = None, **overrides: object
    ) -> Expected:
        """Plain SGD in one process: each step on the mean of the ``world_size`` rank slices' losses of the global
        batch (a per-example mean loss makes that the global batch's loss for any ``world_size``; a loss over the
        batch's shared negatives depends on the slicing). ``model`` default: ``make_model(**overrides)``."""
        config = self.config if config is None else config
        model = self.make_model(**overrides) if model is None else model
        params = dict(model.named_parameters())
        optimizer = torch.optim.SGD([
            {"params": [p for n, p in params.items() if not self.is_table(n)], "lr": self.dense_lr},
            {"params": [p for n, p in params.items() if self.is_table(n)], "lr": self.embedding_lr},
        ])  # fmt: skip
        for step in range(self.steps if steps is None else steps):
            optimizer.zero_grad()
            losses = [self.loss(model, self.rank_batch(config, "train", step, rank, world_size)) for rank in range(world_size)]
            (sum(losses) / world_size).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            predictions = model(self.rank_batch(config, "val", 0, 0, 1))
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if self.compared(k)}
        return Expected(state, predictions)

    def fit_sharded(
        self,
        rank: int,
        world_size: int,
        strategy: TwoDRecStrategy,
        *,
        model: Any = None,
        config: Any = None,
        steps: int | None = None,
        devices: int | None = None,
        num_nodes: int = 1,
        accelerator: str = "cpu",
        callbacks: list[Callback] | None = None,
    ) -> Fitted:
        """Fit ``model`` (default ``make_model()``) with ``strategy`` on ``num_nodes`` nodes of ``devices`` processes
        (default: ``world_size`` on one node), on this rank's slices of ``config``'s global batches.

        ``make_model(embedding_device="meta", seed=None)`` leaves table initialization to TorchRec, with this rank's RNG state.
        """
        config = self.config if config is None else config
        model = self.make_model() if model is None else model
        trainer = Trainer(
            accelerator=accelerator, devices=devices or world_size, num_nodes=num_nodes, strategy=strategy,
            max_steps=self.steps if steps is None else steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        )  # fmt: skip
        trainer.fit(model, datamodule=self.datamodule(config))
        return Fitted(model, trainer, self.local_predictions(model, rank, world_size, config, device=trainer.strategy.root_device))

    def local_predictions(
        self, model: Any, rank: int, world_size: int, config: Any = None, *, device: torch.device | None = None
    ) -> torch.Tensor:
        """``model``'s outputs (in eval mode) on rank ``rank``'s slice of validation batch 0, on the CPU; the ranks'
        outputs concatenate to the unsharded model's. ``device`` default: where the model's dense part is."""
        config = self.config if config is None else config
        if device is None:
            device = next(p for n, p in model.named_parameters() if not self.is_table(n)).device
        model.eval()
        with torch.no_grad():
            return model(self.rank_batch(config, "val", 0, rank, world_size).to(device)).cpu()

    def sgd_strategy(
        self,
        *,
        sharding_types: list[str] | None = None,
        column_width: int | None = None,
        validate_inputs: str = "error",
        check_finite: bool = False,
        **kwargs: Any,
    ) -> TwoDRecStrategy:
        """``TwoDRecStrategy`` with SGD tables at ``embedding_lr`` and a 60 s process-group timeout. The planner's
        allow-list and the guard's settings are spelled flat (``planning=``/``guard=`` replace them). Column-wise
        sharding cuts each table into ``column_width``-wide shards (default ``dim // 2``): TorchRec's default
        ``min_partition`` keeps a table this small in one column shard."""
        kwargs.setdefault("process_group_timeout", 60)
        constraints = {}
        if sharding_types in (["column_wise"], ["table_column_wise"]):
            width = column_width or self.dim // 2
            constraints = {t: TableConstraints(sharding_types=sharding_types, min_partition=width) for t in self.tables}
        kwargs.setdefault("planning", PlanningConfig(sharding_types=sharding_types, table_constraints=constraints))
        kwargs.setdefault("guard", GuardConfig(validate_inputs=validate_inputs, check_finite=check_finite))  # type: ignore[arg-type]
        return TwoDRecStrategy(embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=self.embedding_lr), **kwargs)

    def shards_of(self, model: Any) -> Shards:
        """This rank's pieces of every tensor the reference's state holds: the tables' shards, the dense part whole."""
        return {k: [(o, t.cpu()) for o, t in v] for k, v in local_shards(model).items() if self.compared(k)}

    def table_shards(self, model: Any) -> Shards:
        """This rank's pieces of the embedding tables only."""
        return {k: [(o, t.cpu()) for o, t in v] for k, v in local_shards(model).items() if self.is_table(k)}

    def assert_matches(
        self,
        shards: Sequence[Shards],
        predictions: Sequence[torch.Tensor],
        expected_state: dict[str, torch.Tensor],
        expected_predictions: torch.Tensor,
        **tolerances: Any,
    ) -> None:
        """The ranks' ``shards_of`` assemble to the reference's every tensor and their predictions concatenate to its
        predictions; and training moved ``table_key``, or the comparison proves nothing."""
        for key, expected in expected_state.items():
            assembled = assemble(shards, key, expected)
            torch.testing.assert_close(assembled, expected, msg=lambda m: f"{key}: {m}", **tolerances)
        torch.testing.assert_close(torch.cat(list(predictions)), expected_predictions, **tolerances)
        assert not torch.allclose(self.make_model().state_dict()[self.table_key], expected_state[self.table_key])

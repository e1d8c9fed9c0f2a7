"""How ``TwoDRecStrategy`` runs its ``ShardedRuntime`` from Lightning's hooks: optimizers, steps, replica sync.

The runtime (``lightning_recsys.parallel.sharding.ShardedRuntime``) owns the table optimizers, the
replica sync and its cadence, the accounting and the non-finite guard; these hooks only call it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable, Optional, TypeVar, Union

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_recsys.parallel import EmbeddingOptimizerConfig
from lightning_recsys.parallel.comms import CommAccountant
from lightning_recsys.parallel.sharding import EmbeddingLearningRate, ShardedRuntime
from lightning_recsys.parallel.sync import SyncStats

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def available(value: Optional[_T], attribute: str, after: str) -> _T:
    """``value``, or an error naming ``TwoDRecStrategy.<attribute>`` and what the Trainer must have done first."""
    if value is None:
        raise RuntimeError(f"TwoDRecStrategy.{attribute} is available only after the Trainer has {after}.")
    return value


class ShardedRuntimeHooks:
    """Lightning's optimizer, step and evaluation hooks, mapped onto the strategy's ``ShardedRuntime``."""

    _runtime: Optional[ShardedRuntime]
    _scheduler_base_lr: Optional[float]
    embedding_optimizer_config: EmbeddingOptimizerConfig
    lightning_module: Optional[LightningModule]
    optimizers: list[Optimizer]

    @property
    def comm_accounting(self) -> CommAccountant:
        """Bytes per collective in the last training step and in total; available after setup."""
        return self.runtime.comm

    @property
    def runtime(self) -> ShardedRuntime:
        """The sharded model's run-time state (table optimizers, replica sync, accounting); after setup."""
        return available(self._runtime, "runtime", "set up the model")

    @property
    def data_parallel_table_optimizer(self) -> Optional[Optimizer]:
        """The torch optimizer of the tables planned as data_parallel, or None if there are none."""
        return self._runtime.data_parallel_table_optimizer if self._runtime is not None else None

    # ----------------------------------------------------------------- optimizers, the tables' learning rate, replica sync
    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        removed = self.runtime.strip_embedding_params([_unwrap_optimizer(o) for o in self.optimizers])
        if removed:
            log.debug("TwoDRecStrategy: removed %d embedding parameters from the dense optimizers", removed)
        self.runtime.make_table_optimizers()
        # The rate the first scheduler starts from: LRScheduler records it as initial_lr, but
        # ReduceLROnPlateau records none, and its reductions would never reach the tables.
        self._scheduler_base_lr = None
        if trainer.lr_scheduler_configs:
            group = trainer.lr_scheduler_configs[0].scheduler.optimizer.param_groups[0]
            self._scheduler_base_lr = group.get("initial_lr", group["lr"])
        if self.embedding_optimizer_config.lr_follows_scheduler and not trainer.lr_scheduler_configs:
            rank_zero_warn(
                "EmbeddingOptimizerConfig(lr_follows_scheduler=True), but configure_optimizers returned no LR "
                "scheduler: the tables keep embedding_optimizer.lr."
            )

    @property
    def embedding_learning_rate(self) -> EmbeddingLearningRate:
        """The tables' learning rate (base and factor); available after the optimizers are set up."""
        return available(self.runtime.embedding_lr, "embedding_learning_rate", "set up the optimizers")

    def _scheduler_factor(self) -> Optional[float]:
        """The first LR scheduler's factor (lr / initial_lr, or the lr it started from), when the tables follow it."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self.embedding_optimizer_config.lr_follows_scheduler or trainer is None or not trainer.lr_scheduler_configs:
            return None
        group = trainer.lr_scheduler_configs[0].scheduler.optimizer.param_groups[0]
        base = group.get("initial_lr", self._scheduler_base_lr)
        return group["lr"] / (base if base else group["lr"])

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        automatic = self.lightning_module is None or self.lightning_module.automatic_optimization
        if automatic and self.optimizers and _unwrap_optimizer(optimizer) is _unwrap_optimizer(self.optimizers[0]):
            self._end_step(loss=None)
        return output

    def _end_step(self, *, loss: Any) -> None:
        """The step's updates are applied: check them, step the data-parallel tables, let the replica sync run."""
        if self.runtime.checks_finite:
            self.runtime.check_finite(self._global_step(), before_update=False, loss=loss)
        self.runtime.after_optimizer_step()

    def sync_replicas(self) -> None:
        """Average the embedding shards (and fused optimizer state) over the replica groups now.

        Runs automatically every ``replica_sync.every_n_steps`` steps and before evaluation, saves
        and the end of training; a no-op in 1D or when every table is data_parallel. Every rank must call it.
        """
        self.runtime.sync()

    @property
    def replica_sync_stats(self) -> Optional[SyncStats]:
        """The last replica sync on this rank: rows synced, touched fraction, bytes (None in 1D, before one, or if all data_parallel)."""
        return self.runtime.last_sync_stats

    def _sync_if_pending(self) -> None:
        if self._runtime is not None:
            self._runtime.sync_if_pending()

    def _sync_before_save(self) -> None:
        if self._runtime is not None:
            self._runtime.sync_before_save()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._runtime is not None:
            self._runtime.before_step(self._scheduler_factor())

    # Strategy hooks: evaluation and the end of training always see one synchronized model.
    on_validation_start = on_test_start = on_predict_start = _sync_if_pending

    # ----------------------------------------------------------------- the step and its non-finite checks
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        if self._runtime is None:
            return output
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if self.lightning_module is not None and not self.lightning_module.automatic_optimization:
            # Manual optimization: backward (so FBGEMM's table update) and the optimizer steps ran inside
            # the step, and whether the first optimizer stepped is the module's choice. The step ends
            # here, once per batch: the replica sync must see every batch's table updates.
            self._end_step(loss=loss)
        elif self._runtime.checks_finite:
            self._runtime.check_finite(self._global_step(), before_update=True, loss=loss)
        return output

    def _global_step(self) -> int:
        return self.lightning_module.trainer.global_step if self.lightning_module is not None else -1


def _unwrap_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)

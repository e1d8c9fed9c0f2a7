"""Lightning hooks that run before the strategy's own: the replica sync ahead of user hooks, and which batch hooks follow the input check."""

from __future__ import annotations

from typing import Optional, Protocol

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden


class SyncsReplicas(Protocol):
    """The strategy as ``SyncReplicasFirst`` needs it: a replica sync to run if one is pending."""

    def _sync_if_pending(self) -> None: ...

_BATCH_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


class SyncReplicasFirst(Callback):
    """Syncs the replicas before any callback's or the module's ``on_train_end`` and evaluation-start hooks.

    Lightning calls a hook on the callbacks, then the LightningModule, then the strategy; the strategy's
    own sync in these hooks came after user code that reads the tables (an export or a check at the end
    of training), which saw replicas that differed. The strategy puts this callback first in
    ``trainer.callbacks``; its hooks remain for the case of a Trainer that lost it.
    """

    def __init__(self, strategy: SyncsReplicas) -> None:
        self._strategy = strategy

    def _sync(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.strategy is self._strategy:
            self._strategy._sync_if_pending()

    on_train_end = on_validation_start = on_test_start = on_predict_start = _sync


def batch_hooks_after_the_check(module: Optional[LightningModule]) -> tuple[str, ...]:
    """The module's and DataModule's overridden batch-transfer hooks: Lightning runs them after the strategy's batch check."""
    datamodule = getattr(module.trainer, "datamodule", None) if module is not None and module._trainer is not None else None
    return tuple(
        f"{type(owner).__name__}.{hook}"
        for owner in (module, datamodule) if owner is not None
        for hook in _BATCH_TRANSFER_HOOKS
        if is_overridden(hook, owner)
    )

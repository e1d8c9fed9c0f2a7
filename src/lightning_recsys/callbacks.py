"""Lightning callbacks that surface what TwoDRecStrategy measured."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_recsys.strategies import TwoDRecStrategy


class CommunicationMonitor(Callback):
    """Logs the bytes each collective moved in the training step, as ``comm/<purpose>/<op>/<group>/bytes``.

    Also logs ``comm/inter_node_bytes`` and ``comm/intra_node_bytes``. The numbers are this rank's
    (the logger writes rank 0's); see ``lightning_recsys.parallel.comm_accounting`` for what is counted.

    Args:
        logging_interval: log every this many training steps (default: every step).
    """

    def __init__(self, logging_interval: int = 1) -> None:
        if logging_interval < 1:
            raise ValueError(f"CommunicationMonitor(logging_interval={logging_interval}) must be >= 1.")
        self.logging_interval = logging_interval

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, TwoDRecStrategy):
            raise MisconfigurationException(
                f"CommunicationMonitor needs strategy=TwoDRecStrategy(...); got {type(trainer.strategy).__name__}."
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.logging_interval:
            return
        strategy = trainer.strategy
        assert isinstance(strategy, TwoDRecStrategy)
        pl_module.log_dict(strategy.comm_accounting.as_metrics(), on_step=True, on_epoch=False)

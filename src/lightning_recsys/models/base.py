"""The base LightningModule of every ranker: loss, metrics, logging, dense optimizer."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import IO, Any, Literal

import torch
import torch.nn.functional as F
from lightning.fabric.utilities.types import _MAP_LOCATION_TYPE, _PATH
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.model_helpers import _restricted_classmethod
from torch import nn
from torchmetrics import Metric
from typing_extensions import Self

from lightning_recsys.contracts.model_loading import model_loading
from lightning_recsys.contracts.warm_start import WARM_START_PARTS_KEY, WarmStartable, parts_record
from lightning_recsys.data.batch import RecBatch
from lightning_recsys.models.metrics import AUC, Calibration, LogLoss, NormalizedEntropy

DenseOptimizerName = Literal["sgd", "adagrad", "adam"]

# Epoch metrics logged as ``{stage}/{name}`` on validation and test; all take logits.
_EPOCH_METRICS: dict[str, Callable[[], Metric]] = {
    "auc": AUC,
    "ne": NormalizedEntropy,
    "calibration": Calibration,
    "logloss": LogLoss,
}


def evaluation_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy from logits, exact for infinite logits: 0 when certain and right, +inf when wrong.

    ``F.binary_cross_entropy_with_logits`` computes ``(1 - y) * x``, which is ``0 * inf = NaN`` for
    +inf on a click (and -inf + inf for -inf on a non-click), though such an example costs nothing; it
    is NaN, not +inf, for -inf on a click too. Finite logits keep the function's own value, bit for bit.
    """
    losses = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    certain = ((logits == torch.inf) & (labels == 1)) | ((logits == -torch.inf) & (labels == 0))
    exact = torch.where(certain, torch.zeros_like(losses), torch.full_like(losses, torch.inf))
    return torch.where(logits.isinf(), exact, losses).mean()


class RecsysModule(LightningModule):
    """What every LightningModule of this package shares: the dense optimizer, logging the training loss, and loading checkpoints.

    Subclasses implement ``training_losses(batch) -> {"loss": ..., ...}`` and the evaluation steps.
    Training logs ``train/loss`` (the step's loss, ``training_losses``) every step while a progress bar shows it, and
    otherwise on the steps the loggers write (``Trainer(log_every_n_steps=...)``), on each epoch's
    last batch and on the last step: Lightning's per-step ``self.log`` costs host time.

    Single-device code: it holds plain TorchRec modules and never touches a process group.
    Under TwoDRecStrategy the embedding modules inside it are sharded in place and the
    optimizer returned here only sees the dense parameters.

    Args:
        dense_optimizer: ``sgd``, ``adagrad`` or ``adam`` for the dense (non-embedding) parameters.
        dense_lr: its learning rate.
    """

    def __init__(self, dense_optimizer: DenseOptimizerName = "adagrad", dense_lr: float = 0.05) -> None:
        super().__init__()
        if dense_optimizer not in ("sgd", "adagrad", "adam"):
            raise ValueError(f"dense_optimizer={dense_optimizer!r} is not one of ['sgd', 'adagrad', 'adam'].")
        if not dense_lr > 0:
            raise ValueError(f"dense_lr={dense_lr} must be > 0.")
        self.dense_optimizer_name = dense_optimizer
        self.dense_lr = dense_lr

    @_restricted_classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: _PATH | IO,
        map_location: _MAP_LOCATION_TYPE = None,
        hparams_file: _PATH | None = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        trusted: bool = False,
        **kwargs: Any,
    ) -> Self:
        """Lightning's ``load_from_checkpoint``, which also reads TwoDRecStrategy's checkpoint directories.

        For serving or offline evaluation in one process: the model is built from the saved
        hyperparameters (``kwargs`` override them) with every table whole, on the CPU. Tables saved
        with ``embedding_device="meta"`` are built on the CPU instead, since meta tensors hold no values.
        A checkpoint directory is read without running code from it unless ``trusted=True``
        (``lightning_recsys.checkpoint.to_lightning_checkpoint``, reached through ``contracts.model_loading``).
        """
        if isinstance(checkpoint_path, (str, os.PathLike)) and os.path.isdir(checkpoint_path):
            # Lightning's torch.load cannot open a DCP directory: hand it the same checkpoint as one dict.
            checkpoint = model_loading().read_checkpoint_directory(checkpoint_path, weights_only=weights_only, trusted=trusted)
            if checkpoint.get("hyper_parameters", {}).get("embedding_device") == "meta":
                kwargs.setdefault("embedding_device", None)
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            buffer.seek(0)
            checkpoint_path = buffer
        return super().load_from_checkpoint(  # type: ignore[misc]
            checkpoint_path, map_location=map_location, hparams_file=hparams_file, strict=strict, weights_only=weights_only, **kwargs
        )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of reshaped tables (``PlanningConfig(reshape_tables=True)``) reshapes an unsharded model first.

        Lightning calls this before it loads ``state_dict`` (``load_from_checkpoint``); a model the
        strategy already sharded, or reshaped, is left as it is.
        """
        model_loading().prepare_module(self, checkpoint)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A model with warm-start parts records them (``contracts.warm_start``): a warm start finds them by role."""
        if isinstance(self, WarmStartable):
            checkpoint[WARM_START_PARTS_KEY] = parts_record(self.warm_start_parts())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        losses = self.training_losses(batch)
        if self._train_loss_is_read():
            for name, value in losses.items():
                self.log(f"train/{name}", value, prog_bar=name == "loss", batch_size=batch.batch_size)
        return losses["loss"]

    def training_losses(self, batch: Any) -> dict[str, torch.Tensor]:
        """What training minimizes, ``{"loss": ...}``, and any named parts of it; each is logged as ``train/<name>``."""
        raise NotImplementedError(f"{type(self).__name__} must implement training_losses(batch) -> {{'loss': ...}}.")

    def _train_loss_is_read(self) -> bool:
        """Whether this step's ``train/loss`` reaches a reader: a progress bar, or the loggers' write.

        ``self.log`` costs about 1-2 ms of host time per call in Lightning 2.6 (its result
        collection re-walks the stored metric), so without a progress bar the loss is logged
        only on the steps the loggers write (``log_every_n_steps``) and when training stops.
        """
        trainer = self._trainer
        if trainer is None or trainer.progress_bar_callback is not None:
            return True
        # Lightning's own rule for writing logs (private: _LoggerConnector.should_update_logs).
        if getattr(trainer._logger_connector, "should_update_logs", True):
            return True
        last_of_epoch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        return last_of_epoch or 0 <= trainer.max_steps <= trainer.global_step + 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.dense_optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=self.dense_lr)
        if self.dense_optimizer_name == "adam":
            return torch.optim.Adam(params, lr=self.dense_lr)
        return torch.optim.Adagrad(params, lr=self.dense_lr)


class RankerModule(RecsysModule):
    """Binary click-through ranker. Subclasses implement ``forward(batch) -> logits [B]``.

    Training logs ``train/loss`` as ``RecsysModule`` says (here the click loss).
    Validation and test log ``{stage}/loss`` (mean of per-batch losses) and, per epoch,
    ``{stage}/auc``, ``{stage}/ne``, ``{stage}/calibration`` and ``{stage}/logloss`` (exact over every
    example on every rank). The metric objects are ``self.metrics[f"{stage}_{name}"]``.
    The dense optimizer arguments and the sharding contract are ``RecsysModule``'s.
    """

    def __init__(self, dense_optimizer: DenseOptimizerName = "adagrad", dense_lr: float = 0.05) -> None:
        super().__init__(dense_optimizer=dense_optimizer, dense_lr=dense_lr)
        self.metrics = nn.ModuleDict(
            {f"{stage}_{name}": make() for stage in ("val", "test") for name, make in _EPOCH_METRICS.items()}
        )

    def forward(self, batch: RecBatch) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement forward(batch) -> logits of shape [B].")

    def training_losses(self, batch: RecBatch) -> dict[str, torch.Tensor]:
        """What training minimizes, ``{"loss": ...}``, and any named parts of it; each is logged as ``train/<name>``.

        Here the binary cross-entropy of the click logits. A subclass with an auxiliary loss returns
        the weighted sum as ``loss`` and the terms beside it.
        """
        return {"loss": F.binary_cross_entropy_with_logits(self(batch), batch.labels)}

    def validation_step(self, batch: RecBatch, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "val")

    def test_step(self, batch: RecBatch, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "test")

    def predict_step(self, batch: RecBatch, batch_idx: int) -> torch.Tensor:
        return torch.sigmoid(self(batch))

    def _evaluate(self, batch: RecBatch, stage: str) -> torch.Tensor:
        logits = self(batch)
        loss = evaluation_loss(logits, batch.labels)
        self.log(f"{stage}/loss", loss, batch_size=batch.batch_size, sync_dist=True)
        for name in _EPOCH_METRICS:
            metric = self.metrics[f"{stage}_{name}"]
            metric.update(logits, batch.labels)
            # Logging the Metric object (not a value) lets Lightning compute, sync and reset it per epoch.
            self.log(f"{stage}/{name}", metric, prog_bar=name in ("auc", "ne"), on_step=False, on_epoch=True)
        return loss

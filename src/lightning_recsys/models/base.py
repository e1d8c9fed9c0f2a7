"""The base LightningModule of every ranker: loss, metrics, logging, dense optimizer."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics.classification import BinaryAUROC

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.models.metrics import NormalizedEntropy

DenseOptimizerName = Literal["sgd", "adagrad", "adam"]


class RankerModule(LightningModule):
    """Binary click-through ranker. Subclasses implement ``forward(batch) -> logits [B]``.

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
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_{name}": metric
                for stage in ("val", "test")
                for name, metric in (("auc", BinaryAUROC()), ("ne", NormalizedEntropy()))
            }
        )

    def forward(self, batch: RecBatch) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement forward(batch) -> logits of shape [B].")

    def training_step(self, batch: RecBatch, batch_idx: int) -> torch.Tensor:
        logits = self(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.batch_size)
        return loss

    def validation_step(self, batch: RecBatch, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "val")

    def test_step(self, batch: RecBatch, batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "test")

    def predict_step(self, batch: RecBatch, batch_idx: int) -> torch.Tensor:
        return torch.sigmoid(self(batch))

    def _evaluate(self, batch: RecBatch, stage: str) -> torch.Tensor:
        logits = self(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        auc, ne = self.metrics[f"{stage}_auc"], self.metrics[f"{stage}_ne"]
        auc.update(torch.sigmoid(logits), batch.labels.long())
        ne.update(logits, batch.labels)
        self.log(f"{stage}/loss", loss, batch_size=batch.batch_size, sync_dist=True)
        self.log(f"{stage}/auc", auc, prog_bar=True, on_step=False, on_epoch=True)
        self.log(f"{stage}/ne", ne, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.dense_optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=self.dense_lr)
        if self.dense_optimizer_name == "adam":
            return torch.optim.Adam(params, lr=self.dense_lr)
        return torch.optim.Adagrad(params, lr=self.dense_lr)

"""The DataModule shape every built-in dataset shares: this rank's slice of each split."""

from __future__ import annotations

from typing import Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset

Split = Literal["train", "val", "test"]


class RankSlicedDataModule(LightningDataModule):
    """train/val/test/predict loaders of this rank's slice of every global batch.

    Subclasses build one split's dataset for a rank; the rank and world size come from the
    Trainer (0 of 1 without one). ``predict`` reads the test split (its labels are ignored).
    """

    def _dataset(self, split: Split, rank: int, world_size: int) -> IterableDataset:
        raise NotImplementedError

    def _loader(self, split: Split) -> DataLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        workers = getattr(self, "num_workers", 0)
        return DataLoader(self._dataset(split, rank, world), batch_size=None, num_workers=workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")

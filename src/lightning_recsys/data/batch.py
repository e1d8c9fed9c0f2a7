"""The batch every lightning-recsys model and DataModule exchange."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec import KeyedJaggedTensor


@dataclass
class RecBatch:
    """One (local) batch: dense features ``[B, D]``, sparse features as a KJT, and labels ``[B]``."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "RecBatch":
        return RecBatch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(torch.device(device), non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "RecBatch":
        return RecBatch(dense=self.dense.pin_memory(), sparse=self.sparse.pin(), labels=self.labels.pin_memory())


def sparse_feature_names(num_features: int) -> list[str]:
    """The default sparse feature names, shared by the built-in DataModules and models."""
    return [f"sparse_{i}" for i in range(num_features)]

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


@dataclass
class SequenceBatch:
    """One (local) batch of user activity sequences, for next-item pretraining and its evaluation.

    - ``sparse``: a KJT with, in this order, ``item_id`` (each example's input items, oldest first,
      jagged), ``next_item_id`` (the same values as ``next_item_ids``, with ``item_id``'s lengths), ``action`` (one action type per input item; only where the data has actions) and
      ``negative_item_id`` (the batch's shared pool of sampled negatives, spread over the examples,
      ``ceil``/``floor`` of ``N / B`` ids each, so they ride the same sharded lookup; 0 ids in
      evaluation batches). Every id is a row of the one item table.
    - ``next_item_ids``: ``[sum of item_id lengths]``, the item that followed each input item, aligned
      with ``item_id``'s values. An example's last entry is its target: in training the last training
      item, in validation and test the held-out item.
    - ``seen_ids`` / ``seen_lengths``: per example, every item the user touched before the target
      (its whole history, not cut to the model's maximum length), to be removed from a full ranking;
      empty (lengths 0) in training batches.
    - ``timestamps``: ``[sum of item_id lengths]`` int64, the time (seconds) of each input item, aligned
      with ``item_id``'s values like ``next_item_ids``; ``None`` when the data has no times. The models
      pad them into the same slots as the items (``SequencePretrainer`` passes them to its encoder).
    """

    sparse: KeyedJaggedTensor
    next_item_ids: torch.Tensor
    seen_ids: torch.Tensor
    seen_lengths: torch.Tensor
    timestamps: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.seen_lengths.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SequenceBatch":
        return SequenceBatch(
            sparse=self.sparse.to(torch.device(device), non_blocking=non_blocking),
            next_item_ids=self.next_item_ids.to(device, non_blocking=non_blocking),
            seen_ids=self.seen_ids.to(device, non_blocking=non_blocking),
            seen_lengths=self.seen_lengths.to(device, non_blocking=non_blocking),
            timestamps=None if self.timestamps is None else self.timestamps.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "SequenceBatch":
        return SequenceBatch(
            sparse=self.sparse.pin(),
            next_item_ids=self.next_item_ids.pin_memory(),
            seen_ids=self.seen_ids.pin_memory(),
            seen_lengths=self.seen_lengths.pin_memory(),
            timestamps=None if self.timestamps is None else self.timestamps.pin_memory(),
        )


def sparse_feature_names(num_features: int) -> list[str]:
    """The default sparse feature names, shared by the built-in DataModules and models."""
    return [f"sparse_{i}" for i in range(num_features)]

"""Pretraining DataModules: rank slices of global batches of leave-one-out examples, with sampled negatives.

Batches (``SequenceBatch``, see ``split.py`` for the examples):

- Global batch ``i`` of a split is examples ``[i * B, (i + 1) * B)`` of the split's order, whatever the
  number of ranks ``W``; rank ``r`` takes its ``rank_range`` (``data/ranks.py``) of a
  global batch of ``m`` examples (``B / W`` each when ``m = B``). Every rank builds its slice alone,
  from the same in-memory sequences, so the batches are deterministic per rank.
- Training: users in a new order every epoch when ``shuffle`` (drawn from ``seed`` and the epoch,
  the same on every rank), else in source order. The final partial global batch is dropped on every
  rank (a different one each epoch when shuffled), as the other DataModules of this package do.
- Validation, test and predict: users in source order, and the final partial global batch is kept:
  a full ranking measures every user. Its ``m < B`` examples are cut into the ranks' slices as above
  (sizes differ by at most one); with ``m < W`` some ranks get an empty slice, which the strategy
  skips on every rank, losing those ``m`` users (use ``B`` with ``N mod B`` 0 or at least ``W``).
  Every rank yields the same number of batches.
- Negatives (training only): each rank draws ``num_negatives`` rows uniformly from ``[0, num_items)``
  with replacement for its local batch (from ``seed``, the epoch, the batch index and the rank), and
  spreads the pool over its examples in ``negative_item_id`` (the first ``N mod b`` examples hold
  ``ceil(N / b)`` ids, the others ``floor(N / b)``). ``num_negatives="all"`` makes the pool every
  row ``0 .. num_items - 1`` (with accidental hits masked, the full softmax). Evaluation batches hold
  no negatives and carry the seen ids.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch
from torch.utils.data import IterableDataset

from lightning_recsys.data.batch import SequenceBatch
from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.ranks import check_divisible, rank_range
from lightning_recsys.data.readers import check_global_batch_size
from lightning_recsys.data.sequences.reader import UserSequences
from lightning_recsys.data.sequences.split import LeaveOneOutSplit, sequence_batch

NumNegatives = int | Literal["all"]
_SPLIT_IDS: dict[str, int] = {"train": 0, "val": 1, "test": 2}


def check_int(name: str, value: object, minimum: int, rule: str = "") -> None:
    """``ValueError`` unless ``value`` is an integer >= ``minimum``; ``rule`` adds what the number means."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}{rule}.")


def check_num_negatives(value: object) -> None:
    if value != "all" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"num_negatives={value!r} must be an integer >= 0 or 'all' (every item: the full softmax).")


class SequenceSplitDataset(IterableDataset):
    """Rank ``rank``'s slice of every global batch of one split (see the module docstring)."""

    def __init__(
        self, split_examples: LeaveOneOutSplit, split: Split, *, rank: int, world_size: int, global_batch_size: int,
        max_length: int, num_negatives: NumNegatives, shuffle: bool, seed: int,
    ) -> None:
        check_divisible(global_batch_size, world_size)
        self.examples, self.split = split_examples, split
        self.rank, self.world_size, self.global_batch_size = rank, world_size, global_batch_size
        self.max_length, self.num_negatives, self.shuffle, self.seed = max_length, num_negatives, shuffle, seed
        self.epoch = 0  # passes started; picks the training order and negatives

    @property
    def sequences(self) -> UserSequences:
        return self.examples.sequences

    def __len__(self) -> int:
        count = self.examples.num_examples(self.split)
        return count // self.global_batch_size if self.split == "train" else math.ceil(count / self.global_batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The split's examples (indices into ``examples(split)``) in epoch ``epoch``'s order."""
        count = self.examples.num_examples(self.split)
        if self.split == "train" and self.shuffle:
            return np.random.default_rng([self.seed, epoch]).permutation(count)
        return np.arange(count)

    def negatives(self, epoch: int, batch_index: int) -> torch.Tensor:
        num_items = self.sequences.num_items
        if self.num_negatives == "all":
            return torch.arange(num_items, dtype=torch.long)
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.split], epoch, batch_index, self.rank])
        return torch.from_numpy(rng.integers(0, num_items, size=self.num_negatives, dtype=np.int64))

    def __iter__(self) -> Iterator[SequenceBatch]:
        epoch = self.epoch
        self.epoch += 1
        users, ends = self.examples.examples(self.split)
        order = self.order(epoch)
        for index in range(len(self)):
            chosen = order[index * self.global_batch_size : (index + 1) * self.global_batch_size]
            start, stop = rank_range(len(chosen), self.rank, self.world_size)
            mine = chosen[start:stop]
            negatives = self.negatives(epoch, index) if self.split == "train" else None
            yield sequence_batch(self.sequences, users[mine], ends[mine], self.max_length, negatives=negatives)


class SequencePretrainDataModule(RankSlicedDataModule):
    """The shared part of the pretraining DataModules: the split, the batches, the counts.

    Subclasses read their source in ``_load`` (once, on the first dataloader call or attribute
    read that needs it). Attributes after loading: ``sequences`` (``UserSequences``), ``split``
    (``LeaveOneOutSplit``), ``users_without_eval``, ``users_without_train`` and ``num_examples``.
    """

    def __init__(
        self, *, max_length: int, num_negatives: NumNegatives, global_batch_size: int, shuffle: bool, seed: int
    ) -> None:
        super().__init__()
        check_int("max_length", max_length, 1)
        check_num_negatives(num_negatives)
        check_global_batch_size(global_batch_size)
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle={shuffle!r} must be true or false.")
        check_int("seed", seed, 0)
        self.max_length, self.num_negatives, self.global_batch_size = max_length, num_negatives, global_batch_size
        self.shuffle, self.seed = shuffle, seed
        self._split: LeaveOneOutSplit | None = None

    def _load(self) -> UserSequences:
        raise NotImplementedError

    def _source_name(self) -> str:
        return type(self).__name__

    @property
    def split(self) -> LeaveOneOutSplit:
        """The leave-one-out split of the source (read on first use; its counts logged once, by rank 0)."""
        if self._split is None:
            self._split = LeaveOneOutSplit(self._load())
            if self.trainer is None or self.trainer.global_rank == 0:
                self._split.log_counts(self._source_name())
        return self._split

    @property
    def sequences(self) -> UserSequences:
        return self.split.sequences

    @property
    def users_without_eval(self) -> int:
        """Users with fewer than 3 interactions: no validation or test example (all their items train)."""
        return self.split.users_without_eval

    @property
    def users_without_train(self) -> int:
        """Users whose training part has fewer than 2 items: no training example."""
        return self.split.users_without_train

    @property
    def evaluated_user_ids(self) -> np.ndarray:
        """The source's user ids of the validation, test and predict examples, in batch order (rank 0's
        slice of global batch 0 first): what maps ``predict``'s outputs back to users."""
        users, _ = self.split.examples("test")
        return self.sequences.user_ids[users]

    @property
    def num_examples(self) -> dict[str, int]:
        """Examples per split: ``{"train": ..., "val": ..., "test": ...}``."""
        return {split: self.split.num_examples(split) for split in ("train", "val", "test")}

    def _dataset(self, split: Split, rank: int, world_size: int) -> SequenceSplitDataset:
        dataset = SequenceSplitDataset(
            self.split, split, rank=rank, world_size=world_size, global_batch_size=self.global_batch_size,
            max_length=self.max_length, num_negatives=self.num_negatives, shuffle=self.shuffle, seed=self.seed,
        )
        # A loader made at epoch k (reloaded each epoch, or after resuming) draws epoch k's order, not epoch 0's.
        dataset.epoch = getattr(self.trainer, "current_epoch", 0) or 0
        return dataset

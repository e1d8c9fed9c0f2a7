"""``SequenceParquetRankingDataModule``: the DIN pairs of ``SequenceFileRankingDataModule`` from a prepared directory.

The pairs, their histories and their negatives are built by ``data.sequences.ranking`` (the same
``ImplicitPairs``, ``pair_batch`` and ``untouched_negatives``), so the pretrainer and the ranker
share one prepared directory. What differs from the text path, because no rank holds every user:

- each rank builds the pairs of its own users (``rank_range`` of the global user order, read as
  ``SequenceParquetDataModule`` reads them) and holds those users' sequences in memory: 1/W of the
  data, not all of it, and not the constant memory of the pretraining stream;
- training: each rank shuffles and batches its own pairs (``global_batch_size / W`` examples, whole
  pairs); the ranks' pair counts differ, so every rank stops when the one with the fewest batches
  does (the others' extra batches are dropped and counted by the strategy, a different set each
  epoch when shuffled); the trained users of ``train_user_fraction < 1`` are chosen per user by a
  hash of ``seed`` and the user's global index, not by the text path's permutation;
- validation and test: every user with >= 3 events once, spread evenly over the same number of
  batches on every rank (from the metadata, as ``SequenceParquetDataModule`` does); the fixed
  negatives are drawn from ``seed``, the split and the rank, so they differ from the text path's.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.parquet.contract import PreparedMetadata
from lightning_recsys.data.parquet.reader import PreparedReader, open_prepared, plan_rank
from lightning_recsys.data.parquet.streams import EpochLoader, evaluation_batches, example_bounds
from lightning_recsys.data.ranks import rank_range
from lightning_recsys.data.sequences import UserSequences
from lightning_recsys.data.sequences.ranking import ImplicitPairs, ImplicitPairsDataset, pair_batch, untouched_negatives

_SPLIT_IDS = {"train": 0, "val": 1, "test": 2}


def rank_sequences(path: str, metadata: PreparedMetadata, rank: int, world_size: int) -> tuple[UserSequences, int]:
    """Every user of ``rank`` concatenated (ids as read), and the global index of its first user."""
    reader = PreparedReader(path, metadata, with_user_ids=True, timestamps=False)  # RecBatch pairs carry no times: left unread
    chunks = [reader.read(segment) for segment in plan_rank(metadata, rank, world_size)]
    reader.close()
    first = rank_range(metadata.num_users, rank, world_size)[0]
    if not chunks:
        empty = np.zeros(0, dtype=np.int64)
        return UserSequences(empty, np.zeros(1, dtype=np.int64), empty, metadata.num_items, metadata.num_action_types,
                             empty if metadata.has_actions else None), first
    lengths = np.concatenate([c.sequences.lengths for c in chunks])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    actions = np.concatenate([c.sequences.actions for c in chunks]) if metadata.has_actions else None  # type: ignore[misc]
    sequences = UserSequences(
        items=np.concatenate([c.sequences.items for c in chunks]), offsets=offsets,
        user_ids=np.concatenate([c.sequences.user_ids for c in chunks]), num_items=metadata.num_items,
        num_action_types=metadata.num_action_types, actions=actions,
    )
    return sequences, first


class _EvaluationPairs(IterableDataset):
    """One rank's validation or test pairs over exactly ``num_batches`` non-empty batches."""

    def __init__(self, pairs: ImplicitPairs, split: Split, *, rank: int, num_batches: int, max_history: int, seed: int) -> None:
        self.pairs, self.split, self.rank, self.num_batches, self.max_history = pairs, split, rank, num_batches, max_history
        users, _ = pairs.points(split)
        self.negatives = untouched_negatives(pairs.sequences, users, np.random.default_rng([seed, _SPLIT_IDS[split], rank]))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[RecBatch]:
        users, positions = self.pairs.points(self.split)
        if len(users) < self.num_batches:
            raise ValueError(
                f"rank {self.rank} has {len(users)} {self.split} pairs but every rank must run {self.num_batches} non-empty "
                "batches; use a larger global_batch_size or fewer ranks."
            )
        for index in range(self.num_batches):
            lo, hi = rank_range(len(users), index, self.num_batches)
            yield pair_batch(self.pairs.sequences, users[lo:hi], positions[lo:hi], self.negatives[lo:hi], self.max_history)


class SequenceParquetRankingDataModule(RankSlicedDataModule):
    """DIN-style ranking pairs (``RecBatch``) for ``SequenceRanker`` from a prepared directory; see the module docstring.

    Args:
        path: the prepared directory.
        max_history: the newest this many items before a point form its history.
        train_user_fraction: the fraction of users whose training positions are used, in ``(0, 1]``.
        global_batch_size: examples per step over all ranks (pairs x 2); a multiple of 2 x the world size.
        shuffle: training pairs in a new order each epoch.
        seed: the training order and negatives, the fixed evaluation negatives, the trained users.

    ``num_items`` and ``num_action_types`` come from ``metadata.json`` alone.
    """

    def __init__(
        self, path: str, max_history: int = 50, train_user_fraction: float = 1.0, global_batch_size: int = 256,
        shuffle: bool = True, seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value, minimum in (("max_history", max_history, 1), ("global_batch_size", global_batch_size, 2), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}={value!r} must be an integer >= {minimum}.")
        fraction = train_user_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"train_user_fraction={fraction!r} must be a number in (0, 1].")
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle={shuffle!r} must be true or false.")
        self.path, self.max_history, self.train_user_fraction = str(path), max_history, float(fraction)
        self.global_batch_size, self.shuffle, self.seed = global_batch_size, shuffle, seed
        self._metadata: PreparedMetadata | None = None
        self._pairs: dict[tuple[int, int], ImplicitPairs] = {}

    @property
    def metadata(self) -> PreparedMetadata:
        if self._metadata is None:
            self._metadata = open_prepared(self.path)
        return self._metadata

    @property
    def num_items(self) -> int:
        return self.metadata.num_items

    @property
    def num_action_types(self) -> int:
        return self.metadata.num_action_types

    def pairs(self, rank: int, world_size: int) -> ImplicitPairs:
        """The pairs of ``rank``'s users (read on first use)."""
        if (rank, world_size) not in self._pairs:
            sequences, first = rank_sequences(self.path, self.metadata, rank, world_size)
            train_users = None
            if self.train_user_fraction < 1:
                global_index = np.arange(first, first + sequences.num_users, dtype=np.uint64)
                draws = _unit_hash(global_index, self.seed)
                train_users = np.flatnonzero(draws < self.train_user_fraction)
            self._pairs[(rank, world_size)] = ImplicitPairs(sequences, train_users)
        return self._pairs[(rank, world_size)]

    def _dataset(self, split: Split, rank: int, world_size: int) -> IterableDataset:
        if self.global_batch_size % (2 * world_size):
            raise ValueError(
                f"global_batch_size={self.global_batch_size} must be a multiple of 2 x the world size {world_size}: each rank "
                "takes whole (positive, negative) pairs."
            )
        local = self.global_batch_size // world_size
        pairs = self.pairs(rank, world_size)
        if split == "train":
            dataset = ImplicitPairsDataset(
                pairs, split, rank=0, world_size=1, global_batch_size=local, max_history=self.max_history,
                shuffle=self.shuffle, seed=self.seed * 100_003 + rank,  # each rank its own order and negatives
            )
            dataset.epoch = getattr(self.trainer, "current_epoch", 0) or 0
            return dataset
        uppers = [sum(example_bounds(s, "test")[1] for s in plan_rank(self.metadata, r, world_size)) for r in range(world_size)]
        return _EvaluationPairs(
            pairs, split, rank=rank, num_batches=evaluation_batches(uppers, local // 2), max_history=self.max_history, seed=self.seed
        )

    def _loader(self, split: Split) -> DataLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return EpochLoader(self._dataset(split, rank, world), batch_size=None)


def _unit_hash(values: np.ndarray, seed: int) -> np.ndarray:
    """A uniform draw in ``[0, 1)`` per value, fixed by ``seed`` (splitmix64), whatever the rank that computes it."""
    with np.errstate(over="ignore"):
        z = values + np.uint64((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)


__all__ = ["SequenceParquetRankingDataModule", "rank_sequences"]

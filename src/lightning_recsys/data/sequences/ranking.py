"""Implicit-feedback ranking over a sequence file, DIN's protocol (Zhou et al., KDD 2018, on Amazon reviews).

At each prediction point of a user's sequence ``s`` (oldest first) there are two examples with the
same history, the items before that point:

- the true next item, label 1;
- one item drawn uniformly from those the user never touched (anywhere in ``s``), label 0.

The points follow the leave-one-out split (``split.py``): training uses every position ``p >= 1`` of
the training part (history ``s[:p]``, positive ``s[p]``); validation predicts ``s[n-2]`` from
``s[:n-2]`` and test ``s[n-1]`` from ``s[:n-1]`` (users with ``n >= 3``). Histories keep their newest
``max_history`` items. Training negatives are drawn anew each epoch; validation and test negatives
are fixed by ``seed``, so every run (any world size) ranks the same pairs. A pair's two examples
are always in the same rank's batch, positive first.

Batches are ``RecBatch``es for ``SequenceRanker``: KJT keys ``history_item_id`` (jagged),
``history_action`` (with ``num_action_types > 0``) and ``candidate_item_id`` (one per example); no
dense features (``batch.dense`` is ``[B, 0]``); labels 1.0 / 0.0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchrec import KeyedJaggedTensor

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.ranks import rank_range
from lightning_recsys.data.sequences.module import check_int
from lightning_recsys.data.sequences.reader import UserSequences, read_sequence_file
from lightning_recsys.data.sequences.split import LeaveOneOutSplit, _ranges
from lightning_recsys.contracts.names import CANDIDATE_ITEM_FEATURE, HISTORY_ACTION_FEATURE, HISTORY_ITEM_FEATURE

__all__ = ["ImplicitPairs", "SequenceFileRankingDataModule", "untouched_negatives"]

_SPLIT_IDS = {"train": 0, "val": 1, "test": 2}


def untouched_negatives(sequences: UserSequences, users: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """For each of ``users``, an item drawn uniformly from those that user never touched (rejection sampling)."""
    num_items = sequences.num_items
    touched_counts = np.array([len(np.unique(sequences.items[sequences.offsets[u] : sequences.offsets[u + 1]])) for u in np.unique(users)])
    if len(touched_counts) and touched_counts.max() >= num_items:
        raise ValueError(f"a user touched all {num_items} items: no item is left to draw as that user's negative.")
    user_of_item = np.repeat(np.arange(sequences.num_users, dtype=np.int64), np.diff(sequences.offsets))
    touched = np.unique(user_of_item * num_items + sequences.items)  # sorted (user, item) keys
    drawn = rng.integers(0, num_items, size=len(users), dtype=np.int64)
    while True:
        keys = users.astype(np.int64) * num_items + drawn
        position = np.minimum(np.searchsorted(touched, keys), len(touched) - 1)
        again = np.flatnonzero(touched[position] == keys) if len(touched) else np.zeros(0, dtype=np.int64)
        if not len(again):
            return drawn
        drawn[again] = rng.integers(0, num_items, size=len(again), dtype=np.int64)


class ImplicitPairs:
    """The prediction points of each split as ``(user, position)``: history ``s[:position]``, positive ``s[position]``.

    ``train_users``: the users whose training positions are used (None: all); validation and test
    use every user with at least 3 interactions.
    """

    def __init__(self, sequences: UserSequences, train_users: np.ndarray | None = None) -> None:
        self.sequences = sequences
        split = LeaveOneOutSplit(sequences)
        users, ends = split.examples("train")
        if train_users is not None:
            keep = np.isin(users, train_users)
            users, ends = users[keep], ends[keep]
        # Every position 1 .. end - 1 of each training part.
        counts = ends - 1
        train_positions = _ranges(np.ones_like(ends), ends)
        self._points: dict[Split, tuple[np.ndarray, np.ndarray]] = {"train": (np.repeat(users, counts), train_positions)}
        for name in ("val", "test"):
            eval_users, eval_ends = split.examples(name)  # type: ignore[arg-type]
            self._points[name] = (eval_users, eval_ends - 1)  # type: ignore[index]

    def points(self, split: Split) -> tuple[np.ndarray, np.ndarray]:
        return self._points[split]

    def num_pairs(self, split: Split) -> int:
        return len(self._points[split][0])


class ImplicitPairsDataset(IterableDataset):
    """Rank ``rank``'s slice of every global batch of one split's pairs."""

    def __init__(
        self, pairs: ImplicitPairs, split: Split, *, rank: int, world_size: int, global_batch_size: int, max_history: int,
        shuffle: bool, seed: int,
    ) -> None:
        pairs_per_batch = global_batch_size // 2
        if global_batch_size % 2 or pairs_per_batch % world_size:
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a multiple of 2 x the world size {world_size}: each rank "
                "takes whole (positive, negative) pairs."
            )
        self.pairs, self.split, self.rank, self.world_size = pairs, split, rank, world_size
        self.pairs_per_batch, self.max_history, self.shuffle, self.seed = pairs_per_batch, max_history, shuffle, seed
        self.epoch = 0
        if split != "train":  # fixed by the seed: every run ranks the same pairs
            users, _ = pairs.points(split)
            self._fixed_negatives = untouched_negatives(pairs.sequences, users, np.random.default_rng([seed, _SPLIT_IDS[split]]))

    def __len__(self) -> int:
        count = self.pairs.num_pairs(self.split)
        return count // self.pairs_per_batch if self.split == "train" else math.ceil(count / self.pairs_per_batch)

    def __iter__(self) -> Iterator[RecBatch]:
        epoch = self.epoch
        self.epoch += 1
        users, positions = self.pairs.points(self.split)
        if self.split == "train":
            rng = np.random.default_rng([self.seed, _SPLIT_IDS["train"], epoch])
            negatives = untouched_negatives(self.pairs.sequences, users, rng)
            order = rng.permutation(len(users)) if self.shuffle else np.arange(len(users))
        else:
            negatives, order = self._fixed_negatives, np.arange(len(users))
        for index in range(len(self)):
            chosen = order[index * self.pairs_per_batch : (index + 1) * self.pairs_per_batch]
            start, stop = rank_range(len(chosen), self.rank, self.world_size)
            mine = chosen[start:stop]
            yield pair_batch(self.pairs.sequences, users[mine], positions[mine], negatives[mine], self.max_history)


def pair_batch(sequences: UserSequences, users: np.ndarray, positions: np.ndarray, negatives: np.ndarray, max_history: int) -> RecBatch:
    """Each point as two examples, positive then negative, with the same newest ``max_history`` items as history."""
    first = sequences.offsets[users]
    stop = first + positions
    start = np.maximum(first, stop - max_history)
    # Each example's history positions, every point twice (its positive and its negative).
    start2, stop2 = np.repeat(start, 2), np.repeat(stop, 2)
    history = _ranges(start2, stop2)
    lengths = torch.from_numpy(stop2 - start2)
    candidates = np.stack([sequences.items[stop], negatives], axis=1).reshape(-1)
    keys, values, key_lengths = [HISTORY_ITEM_FEATURE], [torch.from_numpy(sequences.items[history])], [lengths]
    if sequences.actions is not None:
        keys.append(HISTORY_ACTION_FEATURE)
        values.append(torch.from_numpy(sequences.actions[history]))
        key_lengths.append(lengths)
    keys.append(CANDIDATE_ITEM_FEATURE)
    values.append(torch.from_numpy(candidates))
    key_lengths.append(torch.ones(len(candidates), dtype=torch.long))
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(key_lengths))
    labels = torch.tensor([1.0, 0.0]).repeat(len(users))
    return RecBatch(dense=torch.zeros(len(candidates), 0), sparse=sparse, labels=labels)


class SequenceFileRankingDataModule(RankSlicedDataModule):
    """DIN-style implicit-feedback ranking pairs from a BERT4Rec/SASRec ``user item`` file (see the module docstring).

    Args:
        path: the sequence file (``read_sequence_file``; the same file as ``SequenceFileDataModule``).
        num_items: rows of the item table (the largest item id); ids above it are an error.
        num_action_types: with > 0 each line has a third field, the action, emitted as ``history_action``.
        max_history: the newest this many items before a point form its history.
        train_user_fraction: the fraction of users (drawn by ``seed``) whose training positions are used,
            in ``(0, 1]``; validation and test use every user. A foundation-model setting: pretraining
            sees every user, the ranker's labels only some.
        global_batch_size: examples per step over all ranks (pairs x 2); a multiple of 2 x the world size.
        shuffle: training pairs in a new order each epoch.
        seed: the training order and negatives, the fixed evaluation negatives, the trained users.
    """

    def __init__(
        self,
        path: str,
        num_items: int,
        num_action_types: int = 0,
        max_history: int = 50,
        train_user_fraction: float = 1.0,
        global_batch_size: int = 256,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_int("num_items", num_items, 1)
        check_int("num_action_types", num_action_types, 0)
        check_int("max_history", max_history, 1)
        check_int("global_batch_size", global_batch_size, 2)
        check_int("seed", seed, 0)
        fraction = train_user_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"train_user_fraction={fraction!r} must be a number in (0, 1].")
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle={shuffle!r} must be true or false.")
        self.path, self.num_items, self.num_action_types, self.max_history = path, num_items, num_action_types, max_history
        self.train_user_fraction, self.global_batch_size, self.shuffle, self.seed = float(fraction), global_batch_size, shuffle, seed
        self._pairs: ImplicitPairs | None = None

    @property
    def pairs(self) -> ImplicitPairs:
        if self._pairs is None:
            sequences = read_sequence_file(self.path, num_items=self.num_items, num_action_types=self.num_action_types)
            train_users = None
            if self.train_user_fraction < 1:
                count = math.ceil(self.train_user_fraction * sequences.num_users)
                train_users = np.sort(np.random.default_rng([self.seed, 3]).permutation(sequences.num_users)[:count])
            self._pairs = ImplicitPairs(sequences, train_users)
        return self._pairs

    def _dataset(self, split: Split, rank: int, world_size: int) -> ImplicitPairsDataset:
        dataset = ImplicitPairsDataset(
            self.pairs, split, rank=rank, world_size=world_size, global_batch_size=self.global_batch_size,
            max_history=self.max_history, shuffle=self.shuffle, seed=self.seed,
        )
        dataset.epoch = getattr(self.trainer, "current_epoch", 0) or 0
        return dataset

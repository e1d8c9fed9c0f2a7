"""MovieLens-100k as sequences: every rating with the user's earlier training ratings as its history.

The protocol (``MovieLens100KSequenceDataModule``; splits, labels and context as in
``MovieLens100KDataModule``, whose parsing it reuses):

- The history of an example (user ``u``, movie ``m``, timestamp ``t``, in any split) is ``u``'s
  ratings **in the training split** with a timestamp **strictly before** ``t``, oldest first, newest
  last; the newest ``max_history_length`` of them are kept. Validation and test ratings never
  appear in a history, so no held-out label leaks into the inputs.
- Timestamp ties: ratings of one user made in the same second are not each other's history (the
  example's own rating never is); earlier tied ratings keep the file's line order.
- The action type of a history item is its rating value minus one: ratings 1..5 are actions 0..4.
  History items are movie rows (movie id - 1), the rows of the item table, as is the candidate.
- With ``split="time"`` every validation and test example comes after the whole training split, so
  its history is the user's newest training ratings; with ``u1``..``u5``/``ua``/``ub`` (ratings held
  out at random) a test example's history stops at its own timestamp, as a training example's does.
- ``history="all_earlier"`` (``split="time"`` only): a validation or test example's history is every
  rating of its user strictly earlier in time, from any split (train, val and test): what a served
  ranker sees. Training examples' histories do not change. The labels of those earlier held-out
  ratings are what the served ranker would have observed by then; no example sees its own rating
  or a later one. On the random splits it is refused: their test ratings interleave in time with
  the training ones, so a training example would have to be told apart from a test one that
  happened before it, and a test rating's label would be in later training examples' inputs
  whichever way it went.

KJT keys, in this order: ``history_item_id`` and ``history_action`` (jagged, 0 ..
``max_history_length`` per example), ``candidate_item_id`` (the rated movie, one per example), then
the context features ``user_id``, ``genres`` (the candidate's), ``age_bucket``, ``gender``,
``occupation``, ``zip_prefix`` (or the subset ``context_features`` names, in this order) with the rows
of ``MovieLens100KDataModule``'s tables. Dense features
and labels (``rating >= 4``) are ``MovieLens100KDataModule``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.movielens.ratings import (
    MOVIELENS_FEATURE_NAMES,
    MovieLens100K,
    MovieLens100KConfig,
    MovieLens100KDataset,
    MovieLensSplit,
    ValHoldout,
)
from lightning_recsys.data.readers import OnBadLine
from lightning_recsys.contracts.names import CANDIDATE_ITEM_FEATURE, HISTORY_ACTION_FEATURE, HISTORY_ITEM_FEATURE
from lightning_recsys.data.history_shape import SequenceDataShape

MOVIELENS_RATING_VALUES = 5  # ratings 1..5 are history actions 0..4
MOVIELENS_CONTEXT_FEATURES: list[str] = [name for name in MOVIELENS_FEATURE_NAMES if name != "item_id"]
MOVIELENS_SEQUENCE_FEATURE_NAMES: list[str] = [
    HISTORY_ITEM_FEATURE, HISTORY_ACTION_FEATURE, CANDIDATE_ITEM_FEATURE, *MOVIELENS_CONTEXT_FEATURES,
]  # fmt: skip
HistorySource = Literal["train", "all_earlier"]
_HISTORY_SOURCES: tuple[str, ...] = ("train", "all_earlier")
_TIME_BITS = 40  # (user row << 40) + timestamp orders ratings by user, then time; timestamps are < 2**40


@dataclass(kw_only=True)
class MovieLens100KSequenceConfig(MovieLens100KConfig):
    """``MovieLens100KConfig`` plus the history's length.

    Args:
        max_history_length: the newest this many earlier training ratings form the history (the
            longest history emitted).
        context_features: which pooled context features the batches carry, a subset of
            ``user_id, genres, age_bucket, gender, occupation, zip_prefix`` (kept in that order);
            default all. Leave out ``user_id`` to describe a user by the history (and the
            demographics) alone, as some sequence rankers do (on MovieLens-100k that lowered
            validation AUC, on ``u1`` and on ``split="time"``).
        history: ``"train"``: every history holds training ratings only. ``"all_earlier"``
            (``split="time"`` only): a validation or test example's history is every earlier
            rating of its user from any split, as a served ranker sees it; training histories do
            not change.
    """

    max_history_length: int = 100
    context_features: list[str] | None = None
    history: HistorySource = "train"

    def __post_init__(self) -> None:
        super().__post_init__()
        value = self.max_history_length
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"max_history_length={value!r} must be an integer >= 1.")
        if self.history not in _HISTORY_SOURCES:
            raise ValueError(f"history={self.history!r} is not one of {list(_HISTORY_SOURCES)}.")
        if self.history == "all_earlier" and self.split != "time":
            raise ValueError(
                f"history='all_earlier' needs split='time', not split={self.split!r}: in {self.split!r} the test ratings "
                "were held out at random, so they interleave in time with the training ones, and earlier held-out "
                "ratings in a test history would sit among training examples that came after them. Use split='time', "
                "or history='train'."
            )
        chosen = self.context_features
        if chosen is not None:
            unknown = [name for name in chosen if name not in MOVIELENS_CONTEXT_FEATURES]
            if unknown or len(set(chosen)) != len(chosen):
                raise ValueError(
                    f"context_features={chosen!r} must name distinct features among {MOVIELENS_CONTEXT_FEATURES}"
                    + (f"; unknown: {unknown}" if unknown else "; one is named twice")
                    + " (or None for all)."
                )

    @property
    def context_table_sizes(self) -> list[int]:
        sizes = dict(zip(MOVIELENS_FEATURE_NAMES, self.table_sizes))
        return [sizes[name] for name in self.context_feature_names]

    @property
    def context_feature_names(self) -> list[str]:
        chosen = MOVIELENS_CONTEXT_FEATURES if self.context_features is None else self.context_features
        return [name for name in MOVIELENS_CONTEXT_FEATURES if name in chosen]

    @property
    def num_action_types(self) -> int:
        return MOVIELENS_RATING_VALUES


class TrainingHistories:
    """Every user's ratings of ``splits`` (default the training split) by time, to look up the ones strictly before a timestamp.

    ``before(users, timestamps)`` returns, for each example, the newest ``max_length`` of those
    ratings of its user with a smaller timestamp: jagged item rows, actions (rating - 1) and lengths.
    """

    def __init__(self, data: MovieLens100K, max_length: int, splits: tuple[Split, ...] = ("train",)) -> None:
        # Concatenated in split order; the stable sort below keeps each split's (time, line) order within a second.
        train = [r for split in splits for r in data.ratings[split]]
        times = [t for split in splits for t in data.rating_times[split]]
        users = np.array([user for user, _, _ in train], dtype=np.int64).reshape(-1)
        timestamps = np.array([t for _, t in times], dtype=np.int64).reshape(-1)
        if len(timestamps) and timestamps.max() >= 1 << _TIME_BITS:
            raise ValueError(f"a timestamp of {timestamps.max()} does not fit {_TIME_BITS} bits; MovieLens uses Unix seconds.")
        keys = (users << _TIME_BITS) + timestamps
        order = np.argsort(keys, kind="stable")  # train is in time order: ties keep the file's line order
        self.keys = keys[order]
        self.items = np.array([item for _, item, _ in train], dtype=np.int64).reshape(-1)[order]
        self.actions = np.array([rating - 1 for rating, _ in times], dtype=np.int64).reshape(-1)[order]
        self.max_length = max_length

    def before(self, users: np.ndarray, timestamps: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        users = np.asarray(users, dtype=np.int64)
        stop = np.searchsorted(self.keys, (users << _TIME_BITS) + np.asarray(timestamps, dtype=np.int64), side="left")
        first = np.searchsorted(self.keys, users << _TIME_BITS, side="left")
        start = np.maximum(first, stop - self.max_length)
        lengths = stop - start
        # Positions start[b] .. stop[b] - 1 of every example, concatenated.
        offsets = np.repeat(start - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
        positions = np.arange(lengths.sum()) + offsets
        return (torch.from_numpy(self.items[positions]), torch.from_numpy(self.actions[positions]), torch.from_numpy(lengths))


class MovieLens100KSequenceDataset(MovieLens100KDataset):
    """Rank ``rank``'s slice of every global batch of a split, each example with its history (see the module docstring)."""

    def __init__(
        self, data: MovieLens100K, histories: TrainingHistories, split: Split, rank: int = 0, world_size: int = 1,
        context_feature_names: list[str] | None = None,
    ) -> None:
        super().__init__(data, split, rank, world_size)
        self.histories = histories
        self.context_feature_names = list(MOVIELENS_CONTEXT_FEATURES if context_feature_names is None else context_feature_names)

    def _records(self, warn: bool) -> Iterator[tuple[int, int, float, int]]:  # type: ignore[override]
        ratings, times = self.data.ratings[self.split], self.data.rating_times[self.split]
        return ((*ratings[i], times[i][1]) for i in self._order())  # the parent's order, with each timestamp

    def _collate(self, records: list[tuple[int, int, float, int]]) -> RecBatch:  # type: ignore[override]
        pooled = super()._collate([(user, item, label) for user, item, label, _ in records])
        users = np.array([user for user, _, _, _ in records], dtype=np.int64)
        items, actions, lengths = self.histories.before(users, np.array([t for _, _, _, t in records], dtype=np.int64))
        context_names = self.context_feature_names
        context = [pooled.sparse[name] for name in context_names]
        candidate = pooled.sparse["item_id"]
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[HISTORY_ITEM_FEATURE, HISTORY_ACTION_FEATURE, CANDIDATE_ITEM_FEATURE, *context_names],
            values=torch.cat([items, actions, candidate.values(), *(c.values() for c in context)]),
            lengths=torch.cat([lengths, lengths, candidate.lengths(), *(c.lengths() for c in context)]),
        )
        return RecBatch(dense=pooled.dense, sparse=sparse, labels=pooled.labels)


class MovieLens100KSequenceDataModule(SequenceDataShape, RankSlicedDataModule):
    """MovieLens-100k for a sequence ranker: ``MovieLens100KDataModule``'s examples with user histories.

    The arguments are ``MovieLens100KSequenceConfig``'s (flat, so the CLI takes ``--data.path
    <dir>``); ``history="all_earlier"`` gives validation and test examples served-time histories. ``item_table_size``, ``num_action_types`` (5), ``context_feature_names``,
    ``context_table_sizes``, ``num_dense_features`` and ``max_history_length`` describe the batches.
    The files are parsed on the first dataloader call.
    """

    def __init__(
        self,
        path: str,
        split: MovieLensSplit = MovieLens100KSequenceConfig.split,
        train_fraction: float = MovieLens100KSequenceConfig.train_fraction,
        val_fraction: float = MovieLens100KSequenceConfig.val_fraction,
        num_users: int = MovieLens100KSequenceConfig.num_users,
        num_items: int = MovieLens100KSequenceConfig.num_items,
        zip_hash_buckets: int = MovieLens100KSequenceConfig.zip_hash_buckets,
        global_batch_size: int = MovieLens100KSequenceConfig.global_batch_size,
        on_bad_line: OnBadLine = MovieLens100KSequenceConfig.on_bad_line,
        shuffle: bool = MovieLens100KSequenceConfig.shuffle,
        seed: int = MovieLens100KSequenceConfig.seed,
        val_holdout: ValHoldout | None = MovieLens100KSequenceConfig.val_holdout,
        max_history_length: int = MovieLens100KSequenceConfig.max_history_length,
        context_features: list[str] | None = None,
        history: HistorySource = MovieLens100KSequenceConfig.history,
    ) -> None:
        super().__init__()
        self.config = MovieLens100KSequenceConfig(
            path=path, split=split, train_fraction=train_fraction, val_fraction=val_fraction, num_users=num_users,
            num_items=num_items, zip_hash_buckets=zip_hash_buckets, global_batch_size=global_batch_size,
            on_bad_line=on_bad_line, shuffle=shuffle, seed=seed, val_holdout=val_holdout,
            max_history_length=max_history_length, context_features=context_features, history=history,
        )
        self._data: MovieLens100K | None = None
        self._histories: TrainingHistories | None = None
        self._served_histories: TrainingHistories | None = None  # history="all_earlier": every split's ratings

    @classmethod
    def from_config(cls, config: MovieLens100KSequenceConfig) -> MovieLens100KSequenceDataModule:
        return cls(**dataclasses.asdict(config))

    def data(self, warn: bool = True) -> tuple[MovieLens100K, TrainingHistories]:
        """The parsed files and the training histories (parsed once)."""
        if self._data is None or self._histories is None:
            self._data = MovieLens100K(self.config, warn=warn)
            self._histories = TrainingHistories(self._data, self.config.max_history_length)
            if self.config.history == "all_earlier":
                self._served_histories = TrainingHistories(self._data, self.config.max_history_length, splits=("train", "val", "test"))
        return self._data, self._histories

    def _dataset(self, split: Split, rank: int, world_size: int) -> MovieLens100KSequenceDataset:
        data, histories = self.data(warn=rank == 0)  # every rank skips alike; one logs
        if split != "train" and self._served_histories is not None:
            histories = self._served_histories
        dataset = MovieLens100KSequenceDataset(data, histories, split, rank, world_size, self.config.context_feature_names)
        dataset.epoch = getattr(self.trainer, "current_epoch", 0) or 0  # as MovieLens100KDataModule
        return dataset

"""MovieLens-100k as activity sequences: each user's ratings by time, the rating as the action type.

A user's sequence is every rating of ``u.data`` by that user, ordered by timestamp (ratings made in
the same second keep the file's line order). The item is the movie's row (movie id - 1), the action
type the rating minus one (ratings 1..5 are actions 0..4). The files are parsed and checked by
``MovieLens100K`` (``lightning_recsys.data.movielens.ratings``), so ``u.user`` and ``u.item`` must be there
too and a rating of an unknown user or movie is a malformed line. Users come in user-id order; the
split is the leave-one-out split of ``lightning_recsys.data.sequences.split``.
"""

from __future__ import annotations

import numpy as np

from lightning_recsys.data.movielens.ratings import MovieLens100K, MovieLens100KConfig
from lightning_recsys.data.readers import OnBadLine
from lightning_recsys.data.sequences.module import NumNegatives, SequencePretrainDataModule
from lightning_recsys.data.sequences.reader import UserSequences, group_by_user

MOVIELENS_ACTION_TYPES = 5  # ratings 1..5 are actions 0..4


def movielens_sequences(config: MovieLens100KConfig, *, warn: bool = True) -> UserSequences:
    """Every user's ratings of ``u.data`` by timestamp (ties in line order): item rows and actions (rating - 1)."""
    data = MovieLens100K(config, warn=warn)  # split="time", train_fraction=1: every rating, stably sorted by time
    ratings, times = data.ratings["train"], data.rating_times["train"]
    users = np.array([user for user, _, _ in ratings], dtype=np.int64).reshape(-1)
    items = np.array([item for _, item, _ in ratings], dtype=np.int64).reshape(-1)
    actions = np.array([rating - 1 for rating, _ in times], dtype=np.int64).reshape(-1)
    by_user = np.argsort(users, kind="stable")  # stable: each user's ratings stay in time order
    return group_by_user(users[by_user] + 1, items[by_user], actions[by_user], config.num_items, MOVIELENS_ACTION_TYPES)


class MovieLensPretrainDataModule(SequencePretrainDataModule):
    """MovieLens-100k ratings as ``SequenceBatch``es for next-item pretraining (see the module docstring).

    Args:
        path: the extracted ``ml-100k`` directory (``u.data``, ``u.item``, ``u.user``).
        max_length, num_negatives, global_batch_size, shuffle, seed: as ``SequenceFileDataModule``'s.
        num_users, num_items: ids must be in ``1 .. num_users`` / ``1 .. num_items`` (943 and 1682);
            ``num_items`` is the item table's rows.
        on_bad_line: ``"error"`` raises ``MalformedLineError``; ``"skip"`` skips and counts the line
            (``MovieLens100KConfig``'s rule).

    ``num_items`` and ``num_action_types`` (5) are attributes; the files are parsed on the first
    dataloader call or read of the counts.
    """

    def __init__(
        self,
        path: str,
        max_length: int = 50,
        num_negatives: NumNegatives = 128,
        global_batch_size: int = 128,
        shuffle: bool = True,
        seed: int = 0,
        num_users: int = MovieLens100KConfig.num_users,
        num_items: int = MovieLens100KConfig.num_items,
        on_bad_line: OnBadLine = MovieLens100KConfig.on_bad_line,
    ) -> None:
        super().__init__(
            max_length=max_length, num_negatives=num_negatives, global_batch_size=global_batch_size, shuffle=shuffle, seed=seed
        )
        self.movielens = MovieLens100KConfig(
            path=path, split="time", train_fraction=1.0, val_fraction=0.0, num_users=num_users, num_items=num_items,
            on_bad_line=on_bad_line,
        )

    @property
    def num_items(self) -> int:
        return self.movielens.num_items

    @property
    def num_action_types(self) -> int:
        return MOVIELENS_ACTION_TYPES

    def _source_name(self) -> str:
        return f"MovieLens-100k at {self.movielens.path}"

    def _load(self) -> UserSequences:
        return movielens_sequences(self.movielens, warn=self.trainer is None or self.trainer.global_rank == 0)

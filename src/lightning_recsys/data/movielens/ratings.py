"""MovieLens-100k ratings as click-style examples: user and movie features, label ``rating >= 4``.

Point ``MovieLens100KConfig(path=...)`` at the extracted ``ml-100k`` directory. It reads ``u.user``
(``id|age|gender|occupation|zip``), ``u.item`` (``id|title|release date|video release date|IMDb
URL|19 genre flags``, latin-1) and the ratings (``user_id\\titem_id\\trating\\ttimestamp``): ``u.data``
for ``split="time"``, ``uN.base``/``uN.test`` for ``split="u1" .. "u5"``, ``"ua"``, ``"ub"``.
``u.occupation`` is not read: the 21 occupations are fixed (``OCCUPATIONS``). A ratings file may start
with the header line ``user id\\titem id\\trating\\ttimestamp`` (some copies have one); it is skipped.

Sparse features (KJT keys, in this order; ``table_sizes`` gives the rows of each):

=============  =======================================================  ==========================
key            row                                                      rows
=============  =======================================================  ==========================
user_id        user id - 1                                              ``num_users`` (943)
item_id        movie id - 1                                             ``num_items`` (1682)
genres         one row per genre flag set, ``GENRES`` order; a movie    19
               with no flag gets ``unknown`` (row 0, also a genre)
age_bucket     <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+ (ML-1M)      7
gender         M = 0, F = 1                                             2
occupation     index in ``OCCUPATIONS``                                 21
zip_prefix     first 3 characters as a number (000-999) if all three    1000 + ``zip_hash_buckets``
               are digits, else ``1000 + zlib.crc32(prefix) % buckets``
=============  =======================================================  ==========================

Dense features ``[B, 3]`` float32: ``age / 100``; ``(release year - 1900) / 100``, 0.0 when the
movie has no release date; and 1.0 when the release date is missing, else 0.0.

Labels ``[B]`` float32: 1.0 for a rating of 4 or 5, else 0.0.

MovieLens-100k is small, so the files are parsed into memory once (``MovieLens100K``); the
batches are still built one at a time. Every split is emitted in timestamp order (ties keep the
file's line order).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.readers import (
    BadLineTally,
    GlobalBatchDataset,
    OnBadLine,
    check_global_batch_size,
    check_on_bad_line,
    iter_lines,
)

MovieLensSplit = Literal["time", "u1", "u2", "u3", "u4", "u5", "ua", "ub"]
ValHoldout = Literal["newest", "random"]
_VAL_HOLDOUTS: tuple[str, ...] = ("newest", "random")
_MOVIELENS_SPLITS: tuple[str, ...] = ("time", "u1", "u2", "u3", "u4", "u5", "ua", "ub")

OCCUPATIONS: list[str] = [
    "administrator", "artist", "doctor", "educator", "engineer", "entertainment", "executive",
    "healthcare", "homemaker", "lawyer", "librarian", "marketing", "none", "other", "programmer",
    "retired", "salesman", "scientist", "student", "technician", "writer",
]  # fmt: skip
GENRES: list[str] = [
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
    "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
    "War", "Western",
]  # fmt: skip
GENDERS: list[str] = ["M", "F"]
AGE_BUCKET_STARTS: list[int] = [0, 18, 25, 35, 45, 50, 56]  # MovieLens-1M's age groups
MOVIELENS_FEATURE_NAMES: list[str] = [
    "user_id", "item_id", "genres", "age_bucket", "gender", "occupation", "zip_prefix",
]  # fmt: skip
MOVIELENS_NUM_DENSE_FEATURES = 3
POSITIVE_RATING = 4  # ratings >= this are label 1.0
_NUMERIC_ZIP_PREFIXES = 1000
_OCCUPATION_IDS = {name: i for i, name in enumerate(OCCUPATIONS)}
_ENCODING = "latin-1"  # u.item's titles are latin-1; the other files are ASCII
_RATINGS_HEADER = ["user id", "item id", "rating", "timestamp"]
_RatingRow = tuple[int, int, float, int, int]  # user row, item row, label, rating 1-5, timestamp


@dataclass(kw_only=True)
class MovieLens100KConfig:
    """Where MovieLens-100k is and how it is split into train / val / test.

    Args:
        path: the directory holding ``u.data``, ``u.item``, ``u.user`` (and ``u1.base`` ...).
        split: ``"time"``: ``u.data`` sorted by timestamp (stable); the first ``train_fraction``
            is train, the next ``val_fraction`` val, the rest test (with ``n`` ratings, train ends at
            ``round(n * train_fraction)`` and val at ``round(n * (train_fraction + val_fraction))``).
            ``"u1"`` .. ``"u5"``, ``"ua"``, ``"ub"``: test is ``<split>.test``; val is
            ``round(n * val_fraction)`` ratings of ``<split>.base`` (see ``val_holdout``) and train the
            rest of it, so val never overlaps test. ``train_fraction`` is not used.
        train_fraction, val_fraction: see ``split``.
        val_holdout: which ratings of ``<split>.base`` validate. ``"random"`` (the default for
            ``"u1"`` .. ``"ub"``): drawn from ``seed``, as the ``.test`` files were drawn from
            ``u.data``, so validation measures what the test measures. ``"newest"``: the latest by
            timestamp. ``None`` picks ``"newest"`` for ``split="time"`` (its only holdout) and
            ``"random"`` for the others.
        num_users, num_items: rows of the user_id and item_id tables; ids must be in
            ``1 .. num_users`` / ``1 .. num_items`` (943 and 1682 in MovieLens-100k).
        zip_hash_buckets: rows for zip codes whose first 3 characters are not all digits.
        global_batch_size: examples per step across all ranks; it must be divisible by the world
            size. A split's final partial global batch is dropped (on every rank).
        on_bad_line: ``"error"`` raises ``MalformedLineError`` (file, line number, line, problem);
            ``"skip"`` skips the line, counts it, and logs one warning per file. A rating whose user
            or movie line was skipped is then skipped too.
        shuffle: the train split in a new order every epoch (``val`` and ``test`` keep timestamp
            order). The order is drawn from ``seed`` and the epoch number, so every rank draws the
            same one and then takes its slice of each global batch, as without shuffling.
        seed: see ``shuffle`` and ``val_holdout``.
    """

    path: str
    split: MovieLensSplit = "time"
    train_fraction: float = 0.8
    val_fraction: float = 0.1
    num_users: int = 943
    num_items: int = 1682
    zip_hash_buckets: int = 32
    global_batch_size: int = 512
    on_bad_line: OnBadLine = "error"
    shuffle: bool = False
    seed: int = 0
    val_holdout: ValHoldout | None = None

    def __post_init__(self) -> None:
        if self.val_holdout not in (None, *_VAL_HOLDOUTS):
            raise ValueError(f"val_holdout={self.val_holdout!r} must be one of {list(_VAL_HOLDOUTS)} or None.")
        if self.split == "time" and self.val_holdout == "random":
            raise ValueError(
                "val_holdout='random' needs a uN/ua/ub split: split='time' validates on the ratings after train "
                "by timestamp; use val_holdout='newest' or None."
            )
        if not isinstance(self.shuffle, bool):
            raise ValueError(f"shuffle={self.shuffle!r} must be true or false.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be an integer >= 0.")
        if not str(self.path):
            raise ValueError(f"path={self.path!r} must be the MovieLens-100k directory (holding u.data).")
        if self.split not in _MOVIELENS_SPLITS:
            raise ValueError(f"split={self.split!r} is not one of {list(_MOVIELENS_SPLITS)}.")
        if not 0.0 < self.train_fraction <= 1.0:
            raise ValueError(f"train_fraction={self.train_fraction} must be in (0, 1].")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction={self.val_fraction} must be in [0, 1).")
        if self.split == "time" and self.train_fraction + self.val_fraction > 1.0:
            raise ValueError(
                f"train_fraction={self.train_fraction} plus val_fraction={self.val_fraction} must be <= 1 "
                "(the rest is the test split)."
            )
        for name in ("num_users", "num_items", "zip_hash_buckets"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1.")
        check_global_batch_size(self.global_batch_size)
        check_on_bad_line(self.on_bad_line)

    @property
    def effective_val_holdout(self) -> ValHoldout:
        """``val_holdout``, with ``None`` resolved for the split."""
        if self.val_holdout is not None:
            return self.val_holdout
        return "newest" if self.split == "time" else "random"

    @property
    def feature_names(self) -> list[str]:
        return list(MOVIELENS_FEATURE_NAMES)

    @property
    def table_sizes(self) -> list[int]:
        """Rows of each sparse feature's table, in ``feature_names`` order."""
        return [
            self.num_users,
            self.num_items,
            len(GENRES),
            len(AGE_BUCKET_STARTS),
            len(GENDERS),
            len(OCCUPATIONS),
            _NUMERIC_ZIP_PREFIXES + self.zip_hash_buckets,
        ]

    @property
    def num_dense_features(self) -> int:
        return MOVIELENS_NUM_DENSE_FEATURES


def age_bucket(age: int) -> int:
    """MovieLens-1M's age group of ``age``: <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+ -> 0 .. 6."""
    return sum(age >= start for start in AGE_BUCKET_STARTS[1:])


def zip_prefix_row(zip_code: str, hash_buckets: int) -> int:
    """Numeric 3-character prefixes are rows 0-999; others (e.g. Canadian) hash past them.

    ``zlib.crc32`` rather than ``hash()``: Python salts ``str`` hashes per process.
    """
    prefix = zip_code[:3]
    if len(prefix) == 3 and prefix.isascii() and prefix.isdigit():
        return int(prefix)
    return _NUMERIC_ZIP_PREFIXES + zlib.crc32(prefix.encode("utf-8")) % hash_buckets


def _is_whole_number(text: str) -> bool:
    return text.isascii() and text.isdigit()  # int() would also take " 5", "+5" and "5_0"


def _release_year(date: str) -> int | None:
    """The year of ``dd-Mon-yyyy``; ``None`` for an empty date; ``ValueError`` for anything else."""
    if not date:
        return None
    parts = date.split("-")
    if len(parts) != 3 or len(parts[2]) != 4 or not _is_whole_number(parts[2]):
        raise ValueError(f"release date {date!r} is not empty or dd-Mon-yyyy")
    return int(parts[2])


class MovieLens100K:
    """The parsed MovieLens-100k files: per-user and per-movie features, and each split's ratings.

    A rating is ``(user row, item row, label)``; ``ratings[split]`` is in timestamp order.
    ``skipped_lines`` maps each file read to the number of malformed lines skipped in it.
    """

    def __init__(self, config: MovieLens100KConfig, *, warn: bool = True) -> None:
        self.config, self._warn = config, warn
        self.root = Path(config.path)
        self.skipped_lines: dict[str, int] = {}
        # Per user row: age bucket, gender, occupation, zip row (sparse) and age / 100 (dense).
        self.user_sparse = torch.zeros(config.num_users, 4, dtype=torch.long)
        self.user_dense = torch.zeros(config.num_users, 1)
        # Per item row: genre rows (jagged) and (release year - 1900) / 100, release date missing (dense).
        self.item_genres: list[list[int]] = [[] for _ in range(config.num_items)]
        self.item_dense = torch.zeros(config.num_items, 2)
        self._users = self._read_users()
        self._items = self._read_items()
        self.split_files: dict[Split, list[str]] = {}
        rows: dict[Split, list[_RatingRow]]
        if config.split == "time":
            path = self._file("u.data")
            ratings = self._read_ratings(path)
            end_train = round(len(ratings) * config.train_fraction)
            end_val = round(len(ratings) * (config.train_fraction + config.val_fraction))
            rows = {"train": ratings[:end_train], "val": ratings[end_train:end_val], "test": ratings[end_val:]}
            self.split_files = {"train": [path], "val": [path], "test": [path]}
        else:
            base, test = self._file(f"{config.split}.base"), self._file(f"{config.split}.test")
            ratings = self._read_ratings(base)
            held_out = round(len(ratings) * config.val_fraction)
            if config.effective_val_holdout == "newest":
                val_positions = set(range(len(ratings) - held_out, len(ratings)))
            else:
                val_positions = set(np.random.default_rng(config.seed).choice(len(ratings), size=held_out, replace=False).tolist())
            rows = {  # both parts stay in timestamp order
                "train": [r for i, r in enumerate(ratings) if i not in val_positions],
                "val": [r for i, r in enumerate(ratings) if i in val_positions],
                "test": self._read_ratings(test),
            }
            self.split_files = {"train": [base], "val": [base], "test": [test]}
        self.ratings: dict[Split, list[tuple[int, int, float]]] = {s: [r[:3] for r in part] for s, part in rows.items()}
        # Beside ``ratings[split][k]``: its rating value (1-5) and timestamp, for histories (movielens_sequence.py).
        self.rating_times: dict[Split, list[tuple[int, int]]] = {s: [r[3:] for r in part] for s, part in rows.items()}

    def skipped_lines_for(self, split: Split) -> int:
        """Lines skipped in the files behind ``split``: u.user, u.item and its ratings file."""
        files = [self._file("u.user"), self._file("u.item"), *self.split_files[split]]
        return sum(self.skipped_lines.get(path, 0) for path in files)

    def _file(self, name: str) -> str:
        path = self.root / name
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist: MovieLens100KConfig(path={self.config.path!r}, split={self.config.split!r}) "
                f"needs {name}; point path at the extracted ml-100k directory (the one holding u.data, u.item, u.user)."
            )
        return str(path)

    def _read_users(self) -> set[int]:
        path, cfg = self._file("u.user"), self.config
        tally, seen = BadLineTally(path, cfg.on_bad_line, warn=self._warn), set()
        for number, line in iter_lines(path, _ENCODING):
            fields = line.split("|")
            if len(fields) != 5:
                problem = f"expected 5 '|'-separated fields (id|age|gender|occupation|zip), found {len(fields)}"
                tally.bad(number, line, problem)
                continue
            user, age, gender, occupation, zip_code = fields
            if not _is_whole_number(user) or not 1 <= int(user) <= cfg.num_users:
                problem = f"user id {user!r} is not a whole number in 1..num_users={cfg.num_users}"
            elif int(user) in seen:
                problem = f"user id {user} appears twice"
            elif not _is_whole_number(age) or not 0 < int(age) < 150:
                problem = f"age {age!r} is not a whole number in 1..149"
            elif gender not in GENDERS:
                problem = f"gender {gender!r} is not one of {GENDERS}"
            elif occupation not in _OCCUPATION_IDS:
                problem = f"occupation {occupation!r} is not one of the 21 MovieLens occupations {OCCUPATIONS}"
            elif not zip_code:
                problem = "the zip code is empty"
            else:
                row = int(user) - 1
                self.user_sparse[row] = torch.tensor(
                    [
                        age_bucket(int(age)),
                        GENDERS.index(gender),
                        _OCCUPATION_IDS[occupation],
                        zip_prefix_row(zip_code, cfg.zip_hash_buckets),
                    ]
                )
                self.user_dense[row, 0] = int(age) / 100.0
                seen.add(int(user))
                continue
            tally.bad(number, line, problem)
        self.skipped_lines[path] = tally.finish()
        return seen

    def _read_items(self) -> set[int]:
        path, cfg = self._file("u.item"), self.config
        tally, seen = BadLineTally(path, cfg.on_bad_line, warn=self._warn), set()
        num_fields = 5 + len(GENRES)
        for number, line in iter_lines(path, _ENCODING):
            fields = line.split("|")
            if len(fields) != num_fields:
                tally.bad(
                    number,
                    line,
                    f"expected {num_fields} '|'-separated fields (id|title|release date|video release date|"
                    f"IMDb URL|{len(GENRES)} genre flags), found {len(fields)}",
                )
                continue
            item, flags = fields[0], fields[5:]
            if not _is_whole_number(item) or not 1 <= int(item) <= cfg.num_items:
                tally.bad(number, line, f"movie id {item!r} is not a whole number in 1..num_items={cfg.num_items}")
                continue
            if int(item) in seen:
                tally.bad(number, line, f"movie id {item} appears twice")
                continue
            if any(flag not in ("0", "1") for flag in flags):
                tally.bad(number, line, f"genre flags {'|'.join(flags)!r} are not all 0 or 1")
                continue
            try:
                year = _release_year(fields[2])
            except ValueError as error:
                tally.bad(number, line, str(error))
                continue
            row = int(item) - 1
            # No flag set: the movie gets the "unknown" genre, row 0.
            self.item_genres[row] = [g for g, flag in enumerate(flags) if flag == "1"] or [0]
            self.item_dense[row] = torch.tensor([0.0 if year is None else (year - 1900) / 100.0, float(year is None)])
            seen.add(int(item))
        self.skipped_lines[path] = tally.finish()
        return seen

    def _read_ratings(self, path: str) -> list[_RatingRow]:
        """The file's ratings in timestamp order; ``sorted`` is stable, so ties keep the line order."""
        tally = BadLineTally(path, self.config.on_bad_line, warn=self._warn)
        rows: list[_RatingRow] = []
        for number, line in iter_lines(path, _ENCODING):
            fields = line.split("\t")
            if number == 1 and fields == _RATINGS_HEADER:
                continue  # some copies of ml-100k add this header line to u.data and the .base files
            if len(fields) != 4:
                problem = f"expected 4 tab-separated fields (user_id, item_id, rating, timestamp), found {len(fields)}"
            elif not all(_is_whole_number(field) for field in fields):
                problem = f"fields {fields} are not all whole numbers"
            elif not 1 <= int(fields[2]) <= 5:
                problem = f"rating {fields[2]} is not in 1..5"
            elif int(fields[0]) not in self._users:
                problem = f"user_id {fields[0]} is not a user of u.user"
            elif int(fields[1]) not in self._items:
                problem = f"item_id {fields[1]} is not a movie of u.item"
            else:
                user, item, rating, timestamp = (int(field) for field in fields)
                rows.append((user - 1, item - 1, float(rating >= POSITIVE_RATING), rating, timestamp))
                continue
            tally.bad(number, line, problem)
        self.skipped_lines[path] = tally.finish()
        rows.sort(key=lambda row: row[4])
        return rows


class MovieLens100KDataset(GlobalBatchDataset[tuple[int, int, float]]):
    """Rank ``rank``'s slice of every global batch of a MovieLens-100k split.

    ``len()`` is the number of batches: the split's ratings divided by ``global_batch_size``,
    rounded down (the final partial global batch is dropped on every rank). ``skipped_lines``
    counts the malformed lines skipped in u.user, u.item and the split's ratings file.
    """

    def __init__(self, data: MovieLens100K, split: Split, rank: int = 0, world_size: int = 1) -> None:
        super().__init__(global_batch_size=data.config.global_batch_size, rank=rank, world_size=world_size)
        self.data, self.split = data, split
        self.skipped_lines = data.skipped_lines_for(split)
        self.epoch = 0  # passes started; with shuffle, it picks the train split's order

    def __len__(self) -> int:
        return len(self.data.ratings[self.split]) // self.global_batch_size

    def _records(self, warn: bool) -> Iterator[tuple[int, int, float]]:
        ratings = self.data.ratings[self.split]  # parsed (and skips logged) when ``data`` was built
        return (ratings[i] for i in self._order())

    def _order(self) -> list[int] | range:
        """This pass's order of the split's ratings (a pass starts here: it counts the epoch)."""
        count = len(self.data.ratings[self.split])
        self.epoch += 1
        if self.split != "train" or not self.data.config.shuffle:
            return range(count)
        return np.random.default_rng([self.data.config.seed, self.epoch - 1]).permutation(count).tolist()

    def _collate(self, records: list[tuple[int, int, float]]) -> RecBatch:
        data = self.data
        users = torch.tensor([user for user, _, _ in records], dtype=torch.long)
        items = torch.tensor([item for _, item, _ in records], dtype=torch.long)
        labels = torch.tensor([label for _, _, label in records], dtype=torch.float32)
        genres = [data.item_genres[item] for item in items.tolist()]
        user_sparse = data.user_sparse[users].T  # [4, B]: age bucket, gender, occupation, zip row
        ones = torch.ones(len(records), dtype=torch.long)
        values = torch.cat(
            [users, items, torch.tensor([g for row in genres for g in row], dtype=torch.long), user_sparse.reshape(-1)]
        )
        lengths = torch.cat([ones, ones, torch.tensor([len(row) for row in genres], dtype=torch.long), ones.repeat(4)])
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=MOVIELENS_FEATURE_NAMES, values=values, lengths=lengths)
        dense = torch.cat([data.user_dense[users], data.item_dense[items]], dim=1)
        return RecBatch(dense=dense, sparse=sparse, labels=labels)


class MovieLens100KDataModule(RankSlicedDataModule):
    """MovieLens-100k for any ranker; every rank gets its own slice of each global batch.

    The arguments are ``MovieLens100KConfig``'s (flat, so the CLI takes ``--data.path <dir>``).
    ``feature_names``, ``table_sizes`` and ``num_dense_features`` describe the batches, e.g.
    ``DLRMRanker(table_sizes=dm.table_sizes, num_dense_features=dm.num_dense_features,
    feature_names=dm.feature_names)``. The files are parsed on the first dataloader call.
    """

    def __init__(
        self,
        path: str,
        split: MovieLensSplit = MovieLens100KConfig.split,
        train_fraction: float = MovieLens100KConfig.train_fraction,
        val_fraction: float = MovieLens100KConfig.val_fraction,
        num_users: int = MovieLens100KConfig.num_users,
        num_items: int = MovieLens100KConfig.num_items,
        zip_hash_buckets: int = MovieLens100KConfig.zip_hash_buckets,
        global_batch_size: int = MovieLens100KConfig.global_batch_size,
        on_bad_line: OnBadLine = MovieLens100KConfig.on_bad_line,
        shuffle: bool = MovieLens100KConfig.shuffle,
        seed: int = MovieLens100KConfig.seed,
        val_holdout: ValHoldout | None = MovieLens100KConfig.val_holdout,
    ) -> None:
        super().__init__()
        self.config = MovieLens100KConfig(
            path=path, split=split, train_fraction=train_fraction, val_fraction=val_fraction, num_users=num_users,
            num_items=num_items, zip_hash_buckets=zip_hash_buckets, global_batch_size=global_batch_size,
            on_bad_line=on_bad_line, shuffle=shuffle, seed=seed, val_holdout=val_holdout,
        )
        self._data: MovieLens100K | None = None

    @classmethod
    def from_config(cls, config: MovieLens100KConfig) -> MovieLens100KDataModule:
        return cls(**dataclasses.asdict(config))

    @property
    def feature_names(self) -> list[str]:
        return self.config.feature_names

    @property
    def table_sizes(self) -> list[int]:
        return self.config.table_sizes

    @property
    def num_dense_features(self) -> int:
        return self.config.num_dense_features

    def _dataset(self, split: Split, rank: int, world_size: int) -> MovieLens100KDataset:
        if self._data is None:
            self._data = MovieLens100K(self.config, warn=rank == 0)  # every rank skips alike; one logs
        dataset = MovieLens100KDataset(self._data, split, rank, world_size)
        # A loader made at epoch k (reloaded each epoch, or after resuming) draws epoch k's order, not epoch 0's.
        dataset.epoch = getattr(self.trainer, "current_epoch", 0) or 0
        return dataset

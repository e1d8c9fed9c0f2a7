"""MovieLens-100k reader on tiny hand-written files in the real formats."""

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from lightning_recsys.data.movielens.ratings import (
    MOVIELENS_FEATURE_NAMES,
    MovieLens100K,
    MovieLens100KConfig,
    MovieLens100KDataModule,
    MovieLens100KDataset,
    age_bucket,
)
from lightning_recsys.data.readers import MalformedLineError

USERS = [
    "1|24|M|technician|85711",
    "2|53|F|other|94043",
    "3|17|M|writer|T8H1N",  # Canadian: hashed
    "4|45|F|none|02139",
    "5|56|M|retired|L9G2B",  # Canadian: hashed
]
_GENRE_FLAGS = {
    "toy": "0|0|0|1|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0",  # Animation, Children's, Comedy
    "goldeneye": "0|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0|1|0|0",  # Action, Adventure, Thriller
    "unknown": "1|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0",
    "none": "0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0|0",
}
ITEMS = [
    "1|Toy Story (1995)|01-Jan-1995||http://us.imdb.com/M/title-exact?Toy%20Story%20(1995)|" + _GENRE_FLAGS["toy"],
    "2|GoldenEye (1995)|01-Jan-1995||http://us.imdb.com/M/title-exact?GoldenEye%20(1995)|" + _GENRE_FLAGS["goldeneye"],
    "3|unknown||||" + _GENRE_FLAGS["unknown"],  # no release date
    "4|Café (1962)|05-May-1962||http://us.imdb.com/M/title-exact?Caf%E9|" + _GENRE_FLAGS["none"],  # latin-1
]
# user, item, rating, timestamp; out of time order, with a tie (lines 2 and 4 at t=100).
RATINGS = [
    "1\t1\t5\t300",
    "2\t2\t3\t100",
    "3\t3\t4\t200",
    "4\t4\t1\t100",
    "5\t1\t4\t400",
    "1\t2\t2\t500",
    "2\t3\t5\t600",
    "3\t4\t3\t700",
    "4\t1\t4\t800",
    "5\t2\t5\t900",
]
OCCUPATIONS_FILE = ["administrator", "artist"]  # u.occupation is not read; a stub shows that


def _write(path, lines) -> None:
    path.write_bytes("".join(line + "\n" for line in lines).encode("latin-1"))


@pytest.fixture
def ml_dir(tmp_path):
    _write(tmp_path / "u.user", USERS)
    _write(tmp_path / "u.item", ITEMS)
    _write(tmp_path / "u.data", RATINGS)
    _write(tmp_path / "u.occupation", OCCUPATIONS_FILE)
    return tmp_path


def _config(path, **kwargs) -> MovieLens100KConfig:
    kwargs = {"num_users": 5, "num_items": 4, "global_batch_size": 2, **kwargs}
    return MovieLens100KConfig(path=str(path), **kwargs)


def _pairs(batches) -> list[tuple[int, int]]:
    """(user id, movie id) of every example, 1-based as in the files."""
    return [
        (u + 1, i + 1)
        for b in batches
        for u, i in zip(b.sparse["user_id"].values().tolist(), b.sparse["item_id"].values().tolist())
    ]


def test_hand_written_lines_map_to_expected_features(ml_dir):
    config = _config(ml_dir, train_fraction=0.6, val_fraction=0.2, global_batch_size=6)
    (batch,) = list(MovieLens100KDataset(MovieLens100K(config), "train"))
    # Train is the 6 earliest ratings; the t=100 tie keeps line order (user 2 before user 4).
    kjt = batch.sparse
    assert kjt.keys() == MOVIELENS_FEATURE_NAMES
    assert kjt["user_id"].values().tolist() == [1, 3, 2, 0, 4, 0]  # users 2, 4, 3, 1, 5, 1
    assert kjt["item_id"].values().tolist() == [1, 3, 2, 0, 0, 1]  # movies 2, 4, 3, 1, 1, 2
    assert kjt["user_id"].lengths().tolist() == [1] * 6
    # Movie 4 has no genre flag and movie 3 only "unknown": both get genre 0.
    assert kjt["genres"].lengths().tolist() == [3, 1, 1, 3, 3, 3]
    assert kjt["genres"].values().tolist() == [1, 2, 16, 0, 0, 3, 4, 5, 3, 4, 5, 1, 2, 16]
    assert kjt["age_bucket"].values().tolist() == [5, 4, 0, 1, 6, 1]  # ages 53, 45, 17, 24, 56, 24
    assert kjt["gender"].values().tolist() == [1, 1, 0, 0, 0, 0]
    assert kjt["occupation"].values().tolist() == [13, 12, 20, 19, 15, 19]  # other, none, writer, technician, ...
    # Zip prefixes 940, 021, T8H, 857, L9G, 857; 1000 + zlib.crc32(b"T8H") % 32 = 1007, L9G -> 1031.
    assert kjt["zip_prefix"].values().tolist() == [940, 21, 1007, 857, 1031, 857]

    assert batch.labels.dtype == torch.float32 and batch.labels.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    expected_dense = torch.tensor(
        [  # age / 100, (release year - 1900) / 100, release date missing
            [0.53, 0.95, 0.0],
            [0.45, 0.62, 0.0],
            [0.17, 0.0, 1.0],
            [0.24, 0.95, 0.0],
            [0.56, 0.95, 0.0],
            [0.24, 0.95, 0.0],
        ]
    )
    assert batch.dense.dtype == torch.float32
    torch.testing.assert_close(batch.dense, expected_dense)


def test_age_buckets_follow_movielens_1m_boundaries():
    ages = [1, 17, 18, 24, 25, 34, 35, 44, 45, 49, 50, 55, 56, 90]
    assert [age_bucket(a) for a in ages] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]


def test_time_split_counts_order_and_dropped_tail(ml_dir):
    data = MovieLens100K(_config(ml_dir, train_fraction=0.6, val_fraction=0.2))
    splits = {s: list(MovieLens100KDataset(data, s)) for s in ("train", "val", "test")}
    assert _pairs(splits["train"]) == [(2, 2), (4, 4), (3, 3), (1, 1), (5, 1), (1, 2)]
    assert _pairs(splits["val"]) == [(2, 3), (3, 4)]
    assert _pairs(splits["test"]) == [(4, 1), (5, 2)]
    assert [len(MovieLens100KDataset(data, s)) for s in ("train", "val", "test")] == [3, 1, 1]
    assert [b.labels.tolist() for b in splits["test"]] == [[1.0, 1.0]]

    # Default 0.8 / 0.1: 8 / 1 / 1 ratings; a global batch of 3 drops the partial tails.
    data = MovieLens100K(_config(ml_dir, global_batch_size=3))
    assert [len(data.ratings[s]) for s in ("train", "val", "test")] == [8, 1, 1]
    assert [len(list(MovieLens100KDataset(data, s))) for s in ("train", "val", "test")] == [2, 0, 0]


def test_u1_split_reads_base_and_test_with_a_time_tail_for_val(ml_dir):
    _write(ml_dir / "u1.base", ["1\t1\t5\t50", "1\t2\t1\t10", "2\t1\t4\t40", "3\t3\t2\t30", "4\t4\t5\t20"])
    _write(ml_dir / "u1.test", ["5\t1\t4\t5", "5\t2\t1\t1", "2\t4\t5\t3"])
    (ml_dir / "u.data").unlink()  # not needed for u1
    data = MovieLens100K(_config(ml_dir, split="u1", val_fraction=0.2, global_batch_size=1, val_holdout="newest"))
    pairs = {s: _pairs(MovieLens100KDataset(data, s)) for s in ("train", "val", "test")}
    assert pairs["train"] == [(1, 2), (4, 4), (3, 3), (2, 1)]  # time order
    assert pairs["val"] == [(1, 1)]  # the latest rating of u1.base
    assert pairs["test"] == [(5, 2), (2, 4), (5, 1)]


def test_u1_random_holdout_is_seeded_disjoint_and_keeps_time_order(ml_dir):
    base = [f"{1 + k % 5}\t{1 + k // 5}\t{1 + k % 5}\t{1000 - k}" for k in range(20)]  # newest first in the file
    _write(ml_dir / "u1.base", base)
    _write(ml_dir / "u1.test", ["5\t1\t4\t5"])
    config = _config(ml_dir, split="u1", val_fraction=0.25, global_batch_size=1)
    assert config.effective_val_holdout == "random"  # the default for uN splits
    data = MovieLens100K(config)
    train, val = data.ratings["train"], data.ratings["val"]
    assert (len(train), len(val)) == (15, 5)
    timestamps = {(k % 5, k // 5, float(1 + k % 5 >= 4)): 1000 - k for k in range(20)}  # (user, item) is unique here
    assert sorted(train + val) == sorted(timestamps)  # a partition of the base file
    for split in (train, val):
        assert [timestamps[r] for r in split] == sorted(timestamps[r] for r in split)  # time order kept
    newest = MovieLens100K(_config(ml_dir, split="u1", val_fraction=0.25, global_batch_size=1, val_holdout="newest"))
    assert val != newest.ratings["val"]  # not the time tail
    assert MovieLens100K(config).ratings["val"] == val  # the same draw for the same seed: every rank agrees
    assert MovieLens100K(_config(ml_dir, split="u1", val_fraction=0.25, global_batch_size=1, seed=1)).ratings["val"] != val


def test_two_ranks_take_disjoint_halves_of_what_one_rank_gets(ml_dir):
    data = MovieLens100K(_config(ml_dir, train_fraction=1.0, val_fraction=0.0, global_batch_size=4))
    whole = list(MovieLens100KDataset(data, "train"))
    ranks = [list(MovieLens100KDataset(data, "train", rank=r, world_size=2)) for r in range(2)]
    assert len(whole) == len(ranks[0]) == len(ranks[1]) == 2  # 10 ratings: 2 global batches, 2 dropped
    assert _pairs(ranks[0]) == [(2, 2), (4, 4), (5, 1), (1, 2)]
    assert _pairs(ranks[1]) == [(3, 3), (1, 1), (2, 3), (3, 4)]
    for full, r0, r1 in zip(whole, *ranks):
        assert r0.batch_size == r1.batch_size == 2
        for key in MOVIELENS_FEATURE_NAMES:
            assert torch.equal(torch.cat([r0.sparse[key].values(), r1.sparse[key].values()]), full.sparse[key].values())
            assert torch.equal(torch.cat([r0.sparse[key].lengths(), r1.sparse[key].lengths()]), full.sparse[key].lengths())
        assert torch.equal(torch.cat([r0.dense, r1.dense]), full.dense)
        assert torch.equal(torch.cat([r0.labels, r1.labels]), full.labels)
    with pytest.raises(ValueError, match=r"global_batch_size=4 is not divisible by the world size 3"):
        MovieLens100KDataset(data, "train", rank=0, world_size=3)


@pytest.mark.parametrize(
    ("file", "line_number", "bad", "problem"),
    [
        ("u.data", 4, "4\t4\tfive\t100", r"fields \['4', '4', 'five', '100'\] are not all whole numbers"),
        ("u.data", 4, "4\t4\t1", r"expected 4 tab-separated fields .* found 3"),
        ("u.data", 4, "4\t9\t1\t100", r"item_id 9 is not a movie of u.item"),
        ("u.data", 4, "4\t4\t6\t100", r"rating 6 is not in 1..5"),
        ("u.user", 2, "2|53|F|astronaut|94043", r"occupation 'astronaut' is not one of the 21 MovieLens occupations"),
        ("u.user", 2, "2|53|X|other|94043", r"gender 'X' is not one of \['M', 'F'\]"),
        ("u.user", 2, "6|53|F|other|94043", r"user id '6' is not a whole number in 1..num_users=5"),
        ("u.item", 2, ITEMS[1].replace("01-Jan-1995", "1995"), r"release date '1995' is not empty or dd-Mon-yyyy"),
        ("u.item", 2, ITEMS[1].replace("|0|1|1|", "|0|2|1|"), r"genre flags .* are not all 0 or 1"),
        ("u.item", 2, ITEMS[1].rsplit("|", 1)[0], r"expected 24 '\|'-separated fields .* found 23"),
    ],
)
def test_malformed_line_error_names_file_line_content_and_fix(ml_dir, file, line_number, bad, problem):
    lines = {"u.data": RATINGS, "u.user": USERS, "u.item": ITEMS}[file][:]
    lines[line_number - 1] = bad
    _write(ml_dir / file, lines)
    with pytest.raises(MalformedLineError, match=problem) as info:
        MovieLens100K(_config(ml_dir))
    message = str(info.value)
    assert message.startswith(f"{ml_dir / file}, line {line_number}: ")
    shown = bad if len(bad) <= 120 else bad[:120] + "..."  # long lines are truncated
    assert f"The line is {shown!r}." in message and "on_bad_line='skip'" in message


def test_skip_counts_lines_and_drops_ratings_of_skipped_users(ml_dir, caplog):
    users = USERS[:]
    users[4] = "5|56|M|astronaut|L9G2B"  # user 5 is skipped, so are its 2 ratings: 10 - 2 remain
    _write(ml_dir / "u.user", users)
    _write(ml_dir / "u.data", RATINGS[:2] + ["garbage"] + RATINGS[2:])
    config = _config(ml_dir, train_fraction=1.0, val_fraction=0.0, global_batch_size=1, on_bad_line="skip")
    with caplog.at_level(logging.WARNING, logger="lightning_recsys.data.readers"):
        data = MovieLens100K(config)
    assert data.skipped_lines == {str(ml_dir / "u.user"): 1, str(ml_dir / "u.item"): 0, str(ml_dir / "u.data"): 3}
    dataset = MovieLens100KDataset(data, "train")
    assert dataset.skipped_lines == 4
    assert len(list(dataset)) == 8 and all(user != 5 for user, _ in _pairs(dataset))
    warnings = [r.getMessage() for r in caplog.records if r.name == "lightning_recsys.data.readers"]
    assert len(warnings) == 2  # one per file with skipped lines
    assert f"Skipped 1 malformed line(s) of {ml_dir / 'u.user'}" in warnings[0] and "astronaut" in warnings[0]
    assert f"Skipped 3 malformed line(s) of {ml_dir / 'u.data'}" in warnings[1] and "the first was line 3:" in warnings[1]


def test_missing_file_names_the_file_and_the_directory(ml_dir):
    (ml_dir / "u.item").unlink()
    with pytest.raises(FileNotFoundError, match=r"needs u.item; point path at the extracted ml-100k directory"):
        MovieLens100K(_config(ml_dir))


def test_config_validation():
    cases = [
        ({"split": "u9"}, r"split='u9' is not one of \['time', 'u1'"),
        ({"train_fraction": 0.0}, r"train_fraction=0.0 must be in \(0, 1\]"),
        ({"val_fraction": 1.0}, r"val_fraction=1.0 must be in \[0, 1\)"),
        ({"train_fraction": 0.9, "val_fraction": 0.2}, r"train_fraction=0.9 plus val_fraction=0.2 must be <= 1"),
        ({"num_users": 0}, r"num_users=0 must be an integer >= 1"),
        ({"zip_hash_buckets": 0}, r"zip_hash_buckets=0 must be an integer >= 1"),
        ({"global_batch_size": 0}, r"global_batch_size=0 must be an integer >= 1"),
        ({"on_bad_line": "warn"}, r"on_bad_line='warn' is not one of \['error', 'skip'\]"),
        ({"path": ""}, r"path='' must be the MovieLens-100k directory"),
        ({"val_holdout": "oldest"}, r"val_holdout='oldest' must be one of \['newest', 'random'\] or None"),
        ({"val_holdout": "random"}, r"val_holdout='random' needs a uN/ua/ub split: split='time'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            MovieLens100KConfig(**{"path": "ml-100k", **kwargs})
    MovieLens100KConfig(path="ml-100k", split="u1", train_fraction=0.9, val_fraction=0.2)  # train_fraction unused


def test_datamodule_describes_tables_and_takes_rank_from_trainer(ml_dir):
    dm = MovieLens100KDataModule.from_config(_config(ml_dir, train_fraction=0.6, val_fraction=0.2))
    assert dm.feature_names == MOVIELENS_FEATURE_NAMES
    assert dm.table_sizes == [5, 4, 19, 7, 2, 21, 1032] and dm.num_dense_features == 3
    assert MovieLens100KConfig(path="x").table_sizes == [943, 1682, 19, 7, 2, 21, 1032]  # the real dataset
    for batch in dm.train_dataloader():
        for key, rows in zip(dm.feature_names, dm.table_sizes):
            assert 0 <= batch.sparse[key].values().min() and batch.sparse[key].values().max() < rows
    assert _pairs(dm.test_dataloader()) == _pairs(dm.predict_dataloader()) == [(4, 1), (5, 2)]
    assert _pairs(dm.val_dataloader()) == [(2, 3), (3, 4)]

    dm.trainer = SimpleNamespace(global_rank=1, world_size=2)  # what the loaders read from a Trainer
    assert _pairs(dm.train_dataloader()) == [(4, 4), (1, 1), (1, 2)]


def test_shuffle_reorders_train_every_epoch_alike_on_every_rank(ml_dir):
    data = MovieLens100K(_config(ml_dir, train_fraction=1.0, val_fraction=0.0, global_batch_size=2, shuffle=True, seed=3))
    whole = MovieLens100KDataset(data, "train")
    first, second = _pairs(whole), _pairs(whole)
    in_time_order = _pairs(MovieLens100KDataset(MovieLens100K(_config(ml_dir, train_fraction=1.0, val_fraction=0.0, global_batch_size=2)), "train"))
    assert sorted(first) == sorted(second) == sorted(in_time_order) and len(first) == 10
    assert first != second and first != in_time_order  # a new order each epoch
    assert _pairs(MovieLens100KDataset(data, "train")) == first  # drawn from the seed and the epoch
    ranks = [MovieLens100KDataset(data, "train", rank=r, world_size=2) for r in range(2)]
    for expected in (first, second):  # epoch by epoch, the ranks' slices make up the one-rank batches
        halves = [list(r) for r in ranks]
        assert [p for a, b in zip(*halves) for p in _pairs([a]) + _pairs([b])] == expected
    with pytest.raises(ValueError, match="shuffle='yes' must be true or false"):
        MovieLens100KConfig(path="x", shuffle="yes")


def test_shuffle_order_follows_the_trainers_epoch_for_a_fresh_loader(ml_dir):
    """A loader made at epoch k (reload_dataloaders_every_n_epochs, or a run resumed from a checkpoint)
    draws epoch k's order, as the uninterrupted run did, not epoch 0's again."""
    kwargs = {"train_fraction": 1.0, "val_fraction": 0.0, "global_batch_size": 2, "shuffle": True, "seed": 3}
    dm = MovieLens100KDataModule(**dataclasses.asdict(_config(ml_dir, **kwargs)))
    dm.trainer = SimpleNamespace(global_rank=0, world_size=1, current_epoch=0)
    loader = dm.train_dataloader()
    epochs = [_pairs(loader) for _ in range(3)]  # one loader iterated once per epoch
    assert epochs[0] != epochs[1] != epochs[2]
    for epoch in range(3):
        dm.trainer = SimpleNamespace(global_rank=0, world_size=1, current_epoch=epoch)
        assert _pairs(dm.train_dataloader()) == epochs[epoch], epoch

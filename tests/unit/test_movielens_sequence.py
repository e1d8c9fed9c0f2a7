"""MovieLens-100k as sequences: histories are strictly earlier training ratings, newest last, with no held-out label."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_recsys.data.movielens.ratings import MovieLens100K
from lightning_recsys.data.movielens.histories import (
    MOVIELENS_SEQUENCE_FEATURE_NAMES,
    MovieLens100KSequenceConfig,
    MovieLens100KSequenceDataModule,
    MovieLens100KSequenceDataset,
    TrainingHistories,
)

NUM_USERS, NUM_ITEMS = 6, 40
SPLITS = ["time", "u1", "u2", "u3", "u4", "u5", "ua", "ub"]
REAL_DATA = os.environ.get("MOVIELENS_100K_DIR")


def _write_files(directory: Path, seed: int = 0) -> list[tuple[int, int, int, int]]:
    """u.user, u.item, u.data and every uN/ua/ub split; ratings (user, item, rating, timestamp), 1-based,
    with many same-second ties (timestamps drawn from a few values)."""
    rng = np.random.default_rng(seed)
    (directory / "u.user").write_text("".join(f"{u}|{20 + u}|{'MF'[u % 2]}|student|{10000 + u}\n" for u in range(1, NUM_USERS + 1)))
    flags = lambda i: "|".join("1" if g == i % 19 else "0" for g in range(19))  # noqa: E731
    (directory / "u.item").write_text("".join(f"{i}|Movie {i} (1990)|01-Jan-1990||http://x/{i}|{flags(i)}\n" for i in range(1, NUM_ITEMS + 1)))
    ratings = [
        (u, i, int(rng.integers(1, 6)), int(1000 + 10 * rng.integers(0, 12)))
        for u in range(1, NUM_USERS + 1)
        for i in rng.choice(np.arange(1, NUM_ITEMS + 1), size=int(rng.integers(8, 20)), replace=False).tolist()
    ]
    order = rng.permutation(len(ratings))
    ratings = [ratings[k] for k in order]
    line = lambda r: "\t".join(map(str, r)) + "\n"  # noqa: E731
    (directory / "u.data").write_text("".join(map(line, ratings)))
    for k, name in enumerate(["u1", "u2", "u3", "u4", "u5", "ua", "ub"]):
        test = rng.random(len(ratings)) < 0.25
        (directory / f"{name}.base").write_text("".join(line(r) for r, t in zip(ratings, test) if not t))
        (directory / f"{name}.test").write_text("".join(line(r) for r, t in zip(ratings, test) if t))
    return ratings


@pytest.fixture
def ml_dir(tmp_path):
    _write_files(tmp_path)
    return tmp_path


def _read(path: Path) -> list[tuple[int, int, int, int]]:
    return [tuple(int(f) for f in line.split("\t")) for line in path.read_text().splitlines() if not line.startswith("user id")]


def _examples(dm: MovieLens100KSequenceDataModule, split: str):
    """Every example of a split: (user, item, history as [(item, action)]), 1-based ids."""
    for batch in dm._dataset(split, 0, 1):
        kjt = batch.sparse
        items = kjt["history_item_id"].values().split(kjt["history_item_id"].lengths().tolist())
        actions = kjt["history_action"].values().split(kjt["history_action"].lengths().tolist())
        for user, item, h_items, h_actions in zip(kjt["user_id"].values().tolist(), kjt["candidate_item_id"].values().tolist(), items, actions):
            yield user + 1, item + 1, list(zip((h_items + 1).tolist(), h_actions.tolist()))


def _check_histories(dm: MovieLens100KSequenceDataModule, directory: Path) -> int:
    """Brute force over the files: each history is exactly the newest earlier training ratings, newest last."""
    data, _ = dm.data()
    time_of = {(u, i): t for u, i, _, t in _read(directory / "u.data")}
    rating_of = {(u, i): r for u, i, r, _ in _read(directory / "u.data")}
    train = [(u + 1, i + 1) for u, i, _ in data.ratings["train"]]  # in the reader's (stable) timestamp order
    held_out = {(u + 1, i + 1) for s in ("val", "test") for u, i, _ in data.ratings[s]}
    assert held_out and not held_out & set(train)
    checked = 0
    for split in ("train", "val", "test"):
        for user, item, history in _examples(dm, split):
            expected = [(i, rating_of[(u, i)] - 1) for u, i in train if u == user and time_of[(u, i)] < time_of[(user, item)]]
            assert history == expected[-dm.max_history_length :], (split, user, item)
            assert not {(user, i) for i, _ in history} & held_out  # no val or test label in any history
            times = [time_of[(user, i)] for i, _ in history]
            assert times == sorted(times) and all(t < time_of[(user, item)] for t in times)
            checked += 1
    return checked


@pytest.mark.parametrize("split", SPLITS)
def test_histories_are_strictly_earlier_training_ratings_of_the_user(ml_dir, split):
    dm = MovieLens100KSequenceDataModule(
        path=str(ml_dir), split=split, num_users=NUM_USERS, num_items=NUM_ITEMS, global_batch_size=1, max_history_length=6
    )
    assert _check_histories(dm, ml_dir) > 20


def test_time_split_val_and_test_see_the_whole_training_history_but_no_val_rating(ml_dir):
    dm = MovieLens100KSequenceDataModule(path=str(ml_dir), num_users=NUM_USERS, num_items=NUM_ITEMS, global_batch_size=1, max_history_length=50)
    data, _ = dm.data()
    train_of = {}
    for u, i, _ in data.ratings["train"]:
        train_of.setdefault(u + 1, []).append(i + 1)
    for split in ("val", "test"):
        for user, _, history in _examples(dm, split):
            assert [i for i, _ in history] == train_of.get(user, [])


def test_ties_are_not_each_others_history_and_earlier_ties_keep_line_order(tmp_path):
    _write_files(tmp_path)
    # User 1: movies 5 and 3 in the same second (lines in that order), movie 9 a second later, 7 in the same second as 9.
    lines = ["1\t5\t4\t100", "1\t3\t2\t100", "2\t5\t5\t50", "1\t9\t1\t101", "1\t7\t3\t101"]
    (tmp_path / "u.data").write_text("".join(line + "\n" for line in lines))
    dm = MovieLens100KSequenceDataModule(
        path=str(tmp_path), num_users=NUM_USERS, num_items=NUM_ITEMS, global_batch_size=1, train_fraction=1.0, val_fraction=0.0
    )
    histories = {(user, item): history for user, item, history in _examples(dm, "train")}
    assert histories[(1, 5)] == [] and histories[(1, 3)] == []  # same second: neither is the other's history
    assert histories[(1, 9)] == [(5, 3), (3, 1)] == histories[(1, 7)]  # actions are rating - 1
    assert histories[(2, 5)] == []  # another user's ratings never appear


def test_the_newest_ratings_survive_truncation(tmp_path):
    _write_files(tmp_path)
    (tmp_path / "u.data").write_text("".join(f"1\t{i}\t{1 + i % 5}\t{100 + i}\n" for i in range(1, 13)))
    dm = MovieLens100KSequenceDataModule(
        path=str(tmp_path), num_users=NUM_USERS, num_items=NUM_ITEMS, global_batch_size=1, train_fraction=1.0, val_fraction=0.0,
        max_history_length=4,
    )
    last = list(_examples(dm, "train"))[-1]
    assert last[:2] == (1, 12) and last[2] == [(8, 3), (9, 4), (10, 0), (11, 1)]


def test_batches_follow_the_contract_and_ranks_split_them(ml_dir):
    dm = MovieLens100KSequenceDataModule(path=str(ml_dir), split="u1", num_users=NUM_USERS, num_items=NUM_ITEMS, global_batch_size=4)
    assert (dm.item_table_size, dm.num_action_types, dm.num_dense_features, dm.max_history_length) == (NUM_ITEMS, 5, 3, 100)
    assert dm.context_feature_names == ["user_id", "genres", "age_bucket", "gender", "occupation", "zip_prefix"]
    assert dm.context_table_sizes == [NUM_USERS, 19, 7, 2, 21, 1032]
    whole = next(iter(dm._dataset("train", 0, 1)))
    halves = [next(iter(dm._dataset("train", rank, 2))) for rank in range(2)]
    assert whole.sparse.keys() == MOVIELENS_SEQUENCE_FEATURE_NAMES and whole.dense.shape == (4, 3)
    for key in whole.sparse.keys():
        assert torch.equal(torch.cat([h.sparse[key].values() for h in halves]), whole.sparse[key].values()), key
        assert torch.equal(torch.cat([h.sparse[key].lengths() for h in halves]), whole.sparse[key].lengths()), key
    assert whole.sparse["candidate_item_id"].lengths().tolist() == [1] * 4
    actions = torch.cat([b.sparse["history_action"].values() for b in dm._dataset("train", 0, 1)])
    assert set(actions.tolist()) == {0, 1, 2, 3, 4}


def test_context_features_choose_the_pooled_features_and_keep_their_order(ml_dir):
    kwargs = dict(path=str(ml_dir), split="u1", num_users=NUM_USERS, num_items=NUM_ITEMS, global_batch_size=4)
    dm = MovieLens100KSequenceDataModule(**kwargs, context_features=["zip_prefix", "genres", "gender"])
    assert dm.context_feature_names == ["genres", "gender", "zip_prefix"] and dm.context_table_sizes == [19, 2, 1032]
    batch, full = next(iter(dm._dataset("train", 0, 1))), next(iter(MovieLens100KSequenceDataModule(**kwargs)._dataset("train", 0, 1)))
    assert batch.sparse.keys() == ["history_item_id", "history_action", "candidate_item_id", "genres", "gender", "zip_prefix"]
    for key in batch.sparse.keys():
        assert torch.equal(batch.sparse[key].values(), full.sparse[key].values()), key


@pytest.mark.parametrize(("features", "match"), [(["user"], r"unknown: \['user'\]"), (["genres", "genres"], "one is named twice")])
def test_bad_context_features_raise_naming_the_choices(ml_dir, features, match):
    with pytest.raises(ValueError, match=rf"context_features=.* must name distinct features among \['user_id', .*{match}"):
        MovieLens100KSequenceDataModule(path=str(ml_dir), context_features=features)


def test_shuffled_epochs_give_each_example_the_same_history(ml_dir):
    kwargs = dict(path=str(ml_dir), split="u2", num_users=NUM_USERS, num_items=NUM_ITEMS, global_batch_size=1)
    plain = {(u, i): h for u, i, h in _examples(MovieLens100KSequenceDataModule(**kwargs), "train")}
    shuffled = list(_examples(MovieLens100KSequenceDataModule(**kwargs, shuffle=True), "train"))
    assert [(u, i) for u, i, _ in shuffled] != list(plain)
    assert {(u, i): h for u, i, h in shuffled} == plain


def test_a_ratings_header_line_is_skipped(ml_dir):
    body = (ml_dir / "u.data").read_text()
    (ml_dir / "u.data").write_text("user id\titem id\trating\ttimestamp\n" + body)
    config = MovieLens100KSequenceConfig(path=str(ml_dir), num_users=NUM_USERS, num_items=NUM_ITEMS)
    assert sum(len(MovieLens100K(config).ratings[s]) for s in ("train", "val", "test")) == len(body.splitlines())


def test_max_history_length_is_validated(ml_dir):
    with pytest.raises(ValueError, match="max_history_length=0 must be an integer >= 1"):
        MovieLens100KSequenceDataModule(path=str(ml_dir), max_history_length=0)


def test_history_lookup_handles_users_without_training_ratings(ml_dir):
    data = MovieLens100K(MovieLens100KSequenceConfig(path=str(ml_dir), num_users=NUM_USERS + 2, num_items=NUM_ITEMS))
    items, actions, lengths = TrainingHistories(data, 3).before(np.array([NUM_USERS + 1, 0]), np.array([10**9, 10**9]))
    assert lengths.tolist() == [0, 3] and items.numel() == actions.numel() == 3


@pytest.mark.slow
@pytest.mark.skipif(REAL_DATA is None, reason="set MOVIELENS_100K_DIR to the extracted ml-100k directory (not bundled: its licence forbids redistribution)")
@pytest.mark.parametrize("split", ["time", "u1", "ua"])
def test_real_movielens_histories_leak_no_held_out_rating(split):
    dm = MovieLens100KSequenceDataModule(path=REAL_DATA, split=split, global_batch_size=512, max_history_length=100)
    data, _ = dm.data()
    held_out = {(u, i) for s in ("val", "test") for u, i, _ in data.ratings[s]}
    for s in ("train", "val", "test"):
        for user, item, history in _examples(dm, s):
            assert not {(user - 1, i - 1) for i, _ in history} & held_out

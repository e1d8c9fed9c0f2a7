"""MovieLens-100k as pretraining sequences: each user's ratings by time (ties in line order), rating - 1 as the action."""

from __future__ import annotations

import os

import pytest
import torch
from movielens_files import write_tiny_movielens

from lightning_recsys.data import MalformedLineError, MovieLensPretrainDataModule
from lightning_recsys.data.sequences import ACTION_FEATURE, ITEM_FEATURE, NEGATIVE_FEATURE, NEXT_ITEM_FEATURE

REAL_DATA = os.environ.get("MOVIELENS_100K_DIR")


def _expected_sequences(directory) -> dict[int, list[tuple[int, int]]]:
    """Per user id: (movie row, action) of its ratings by timestamp, ties in line order, written out by hand."""
    rows = [line.split("\t") for line in (directory / "u.data").read_text().splitlines()]
    ordered = sorted(enumerate(rows), key=lambda pair: (int(pair[1][0]), int(pair[1][3]), pair[0]))
    sequences: dict[int, list[tuple[int, int]]] = {}
    for _, (user, item, rating, _) in ordered:
        sequences.setdefault(int(user), []).append((int(item) - 1, int(rating) - 1))
    return sequences


def test_each_users_ratings_by_time_with_ties_in_line_order_and_the_rating_as_action(tmp_path):
    write_tiny_movielens(tmp_path)
    # Five timestamps, out of line order: each user has many ratings in the same second.
    ratings = (f"{1 + r % 20}\t{1 + (r * 7 + r // 20) % 30}\t{1 + r % 5}\t{880000000 + (r * 37) % 5}\n" for r in range(400))
    (tmp_path / "u.data").write_text("".join(ratings))
    dm = MovieLensPretrainDataModule(str(tmp_path), global_batch_size=4, num_negatives=6, max_length=8)
    expected = _expected_sequences(tmp_path)
    sequences = dm.sequences
    assert sequences.user_ids.tolist() == sorted(expected)
    for u, user in enumerate(sequences.user_ids.tolist()):
        span = slice(sequences.offsets[u], sequences.offsets[u + 1])
        assert list(zip(sequences.items[span].tolist(), sequences.actions[span].tolist())) == expected[user]
    assert dm.num_items == 1682 and dm.num_action_types == 5


def test_batches_go_through_the_leave_one_out_split_with_actions(tmp_path):
    write_tiny_movielens(tmp_path, spread_items=True)
    dm = MovieLensPretrainDataModule(str(tmp_path), global_batch_size=4, num_negatives=6, max_length=8, shuffle=False)
    expected = _expected_sequences(tmp_path)
    assert dm.num_examples == {"train": 20, "val": 20, "test": 20} and dm.users_without_eval == 0
    test = list(dm._dataset("test", 0, 1))
    targets = torch.cat([b.next_item_ids[torch.cumsum(b.sparse[ITEM_FEATURE].lengths(), 0) - 1] for b in test])
    assert targets.tolist() == [expected[user][-1][0] for user in sorted(expected)]
    seen = torch.cat([b.seen_ids for b in test])
    assert seen.tolist() == [item for user in sorted(expected) for item, _ in expected[user][:-1]]
    first = test[0].sparse
    assert first.keys() == [ITEM_FEATURE, NEXT_ITEM_FEATURE, ACTION_FEATURE, NEGATIVE_FEATURE]
    assert first[ACTION_FEATURE].values().tolist()[:8] == [action for _, action in expected[1][-9:-1]]  # newest 8 inputs
    train = next(iter(dm._dataset("train", 0, 2)))
    assert train.sparse[NEGATIVE_FEATURE].lengths().tolist() == [3, 3]
    assert train.sparse[ACTION_FEATURE].values().max() <= 4


def test_a_bad_rating_line_names_the_file_and_line(tmp_path):
    write_tiny_movielens(tmp_path)
    lines = (tmp_path / "u.data").read_text().splitlines()
    lines[4] = "1\t2\t9\t880000000"
    (tmp_path / "u.data").write_text("\n".join(lines) + "\n")
    with pytest.raises(MalformedLineError, match=r"u.data, line 5: rating 9 is not in 1..5"):
        MovieLensPretrainDataModule(str(tmp_path)).sequences  # noqa: B018


@pytest.mark.skipif(not REAL_DATA, reason="set MOVIELENS_100K_DIR to the extracted ml-100k directory to run it")
def test_the_real_files():
    dm = MovieLensPretrainDataModule(REAL_DATA)
    assert dm.sequences.num_users == 943 and len(dm.sequences.items) == 100_000
    assert dm.num_examples["test"] == 943  # every user has at least 20 ratings

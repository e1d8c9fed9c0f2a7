"""MovieLens-100k sequences with history="all_earlier": validation and test examples see every earlier rating of
their user from any split (a served ranker's view); training is unchanged; random splits refuse it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_recsys.data.movielens.histories import MovieLens100KSequenceConfig, MovieLens100KSequenceDataModule
from lightning_recsys.models import SequenceRanker
from tests.unit.test_movielens_sequence import NUM_ITEMS, NUM_USERS, _examples, _read, _write_files

MAX_HISTORY = 6


def _module(directory: Path, **overrides: object) -> MovieLens100KSequenceDataModule:
    arguments = dict(path=str(directory), num_users=NUM_USERS, num_items=NUM_ITEMS, global_batch_size=4, max_history_length=MAX_HISTORY)
    return MovieLens100KSequenceDataModule(**{**arguments, "history": "all_earlier", **overrides})  # type: ignore[arg-type]


def test_val_and_test_histories_are_every_earlier_rating_of_the_user_from_any_split(tmp_path):
    _write_files(tmp_path)
    dm = _module(tmp_path, global_batch_size=1)
    data, _ = dm.data()
    rows = _read(tmp_path / "u.data")
    time_of = {(u, i): t for u, i, _, t in rows}
    rating_of = {(u, i): r for u, i, r, _ in rows}
    in_order = [(u + 1, i + 1) for split in ("train", "val", "test") for u, i, _ in data.ratings[split]]  # time order, ties by line
    held_out = {(u + 1, i + 1) for split in ("val", "test") for u, i, _ in data.ratings[split]}
    seen_held_out = 0
    for split in ("val", "test"):
        for user, item, history in _examples(dm, split):
            expected = [(i, rating_of[(u, i)] - 1) for u, i in in_order if u == user and time_of[(u, i)] < time_of[(user, item)]]
            assert history == expected[-MAX_HISTORY:], (split, user, item)
            assert all(i != item for i, _ in history)  # a user rates a movie once: its own rating is never in it
            seen_held_out += len({(user, i) for i, _ in history} & held_out)
    assert seen_held_out > 0  # the option changed something: earlier held-out ratings are in some histories
    # Training histories are the training-only ones.
    train_only = MovieLens100KSequenceDataModule(
        path=str(tmp_path), num_users=NUM_USERS, num_items=NUM_ITEMS, global_batch_size=1, max_history_length=MAX_HISTORY
    )
    assert list(_examples(dm, "train")) == list(_examples(train_only, "train"))


def _flip_ratings(directory: Path, chosen: set[tuple[int, int]]) -> None:
    rows = _read(directory / "u.data")
    flipped = [(u, i, 6 - r if (u, i) in chosen else r, t) for u, i, r, t in rows]
    (directory / "u.data").write_text("".join("\t".join(map(str, row)) + "\n" for row in flipped))


def _training_losses(dm: MovieLens100KSequenceDataModule) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = SequenceRanker(
        item_table_size=NUM_ITEMS, num_action_types=5, context_feature_names=dm.config.context_feature_names,
        context_table_sizes=dm.config.context_table_sizes, num_dense_features=dm.num_dense_features, embedding_dim=8,
        max_history=MAX_HISTORY, num_layers=1, num_heads=2, newest_tokens=2, dropout=0.0, over_arch_layer_sizes=[4, 1],
    )
    return [model.training_losses(batch)["loss"].detach() for batch in dm._dataset("train", 0, 1)]


def test_training_is_bit_identical_when_every_held_out_rating_is_flipped(tmp_path):
    _write_files(tmp_path)
    before = _module(tmp_path)
    data, _ = before.data()
    held_out = {(u + 1, i + 1) for split in ("val", "test") for u, i, _ in data.ratings[split]}  # every test rating, and val
    losses = _training_losses(before)
    test_batches = [b.sparse["history_action"].values() for b in before._dataset("test", 0, 1)]
    _flip_ratings(tmp_path, held_out)
    after = _module(tmp_path)
    assert [torch.equal(a, b) for a, b in zip(losses, _training_losses(after), strict=True)] == [True] * len(losses)
    flipped_batches = [b.sparse["history_action"].values() for b in after._dataset("test", 0, 1)]
    assert any(not torch.equal(a, b) for a, b in zip(test_batches, flipped_batches, strict=True))  # test histories did see them


@pytest.mark.parametrize("split", ["u1", "ua", "ub"])
def test_random_splits_refuse_it_saying_why(tmp_path, split):
    with pytest.raises(ValueError, match=rf"history='all_earlier' needs split='time', not split='{split}'.*interleave in time"):
        MovieLens100KSequenceConfig(path=str(tmp_path), split=split, history="all_earlier")
    with pytest.raises(ValueError, match=r"history='served' is not one of \['train', 'all_earlier'\]"):
        MovieLens100KSequenceConfig(path=str(tmp_path), history="served")  # type: ignore[arg-type]

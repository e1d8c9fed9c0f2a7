"""Sequence files (BERT4Rec/SASRec format): the reader, the leave-one-out split, ranks, and negatives."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_recsys.data import MalformedLineError, SequenceFileDataModule
from lightning_recsys.data.sequences import (
    ACTION_FEATURE,
    ITEM_FEATURE,
    NEGATIVE_FEATURE,
    NEXT_ITEM_FEATURE,
    LeaveOneOutSplit,
    read_sequence_file,
)
from lightning_recsys.data.sequences.reader import _parse_clean, _parse_exactly


def _write(path: Path, sequences: dict[int, list[int]], actions: dict[int, list[int]] | None = None) -> Path:
    lines = []
    for user, items in sequences.items():
        for k, item in enumerate(items):
            lines.append(f"{user} {item}" + (f" {actions[user][k]}" if actions else ""))
    path.write_text("\n".join(lines) + "\n")
    return path


def _examples(batch) -> list[dict[str, list[int]]]:
    """Per example: its input items, next items, seen ids and negatives, as lists."""
    kjt = batch.sparse
    items, negatives = kjt[ITEM_FEATURE], kjt[NEGATIVE_FEATURE]
    nexts = torch.split(batch.next_item_ids, items.lengths().tolist())
    seen = torch.split(batch.seen_ids, batch.seen_lengths.tolist())
    return [
        {"input": i.tolist(), "next": n.tolist(), "seen": s.tolist(), "negatives": g.tolist()}
        for i, n, s, g in zip(
            torch.split(items.values(), items.lengths().tolist()), nexts, seen,
            torch.split(negatives.values(), negatives.lengths().tolist()),
        )
    ]


def _all_examples(dm: SequenceFileDataModule, split: str, rank: int = 0, world: int = 1) -> list[dict[str, list[int]]]:
    return [example for batch in dm._dataset(split, rank, world) for example in _examples(batch)]


# Users of every length class: 6 items, 3 (no training example), 2 (train only), 1 (nothing), 4.
SMALL = {11: [1, 2, 3, 4, 5, 6], 12: [7, 8, 9], 13: [10, 11], 14: [12], 15: [13, 14, 15, 16]}


def _rows(ids: list[int]) -> list[int]:
    return [i - 1 for i in ids]


# ---------------------------------------------------------------------------------------------- reader


def test_reader_groups_users_in_file_order_with_item_rows(tmp_path):
    sequences = read_sequence_file(_write(tmp_path / "s.txt", SMALL))
    assert sequences.user_ids.tolist() == [11, 12, 13, 14, 15]
    assert sequences.num_items == 16 and sequences.num_action_types == 0 and sequences.actions is None
    for u, items in enumerate(SMALL.values()):
        assert sequences.items[sequences.offsets[u] : sequences.offsets[u + 1]].tolist() == _rows(items)


def test_reader_takes_tabs_runs_of_spaces_crlf_no_final_newline_and_gzip(tmp_path):
    text = "1\t3\r\n1   2\n2 \t 5\n2 1"
    plain = tmp_path / "a.txt"
    plain.write_bytes(text.encode())
    packed = tmp_path / "a.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    for path in (plain, packed):
        sequences = read_sequence_file(path, num_items=9)
        assert sequences.items.tolist() == [2, 1, 4, 0] and sequences.offsets.tolist() == [0, 2, 4]
        assert sequences.num_items == 9


def test_fast_and_exact_parsers_agree_on_a_clean_file(tmp_path):
    rng = np.random.default_rng(0)
    lines = [f"{u} {i}" for u in range(1, 200) for i in rng.integers(1, 500, rng.integers(1, 9))]
    path = tmp_path / "clean.txt"
    path.write_text("\n".join(lines) + "\n")
    fast = _parse_clean(path.read_bytes(), 2)
    assert fast is not None
    np.testing.assert_array_equal(fast, _parse_exactly(str(path), 2, None, 0))


def test_reader_reads_actions_as_a_third_field(tmp_path):
    path = _write(tmp_path / "a.txt", {1: [4, 5, 6]}, actions={1: [2, 0, 1]})
    sequences = read_sequence_file(path, num_action_types=3)
    assert sequences.actions.tolist() == [2, 0, 1] and sequences.num_action_types == 3


BAD_FILES = [
    ("1 2\n1 x\n", 2, "item id 'x' is not a whole number", {}),
    ("1 2\n1 -3\n", 2, "item id '-3' is not a whole number", {}),
    ("1 2\n1 0\n", 2, "item id 0 is below 1", {}),
    ("1 2\n0 3\n", 2, "user id 0 is below 1", {}),
    ("1 2\n1 2 3\n", 2, "expected 2 whitespace-separated fields (user item), found 3", {}),
    ("1 2\n\n1 3\n", 2, "found 0", {}),
    ("1 2\n1 2.5\n", 2, "not a whole number", {}),
    ("1 2\n2 3\n2 4\n1 5\n", 4, "user 1's lines are not contiguous: its earlier lines end at line 1", {}),
    ("1 2\n1 4\n", 2, "item id 4 is above num_items=3", {"num_items": 3}),
    ("1 2 0\n1 3 2\n", 2, "action type 2 is not in 0..1", {"num_action_types": 2}),
    ("1 2\n1 3\n", 1, "expected 3 whitespace-separated fields (user item action), found 2", {"num_action_types": 2}),
    ("1 2\n1 1234567890123456789\n", 2, "more than 18 digits", {}),
    ("1 2\n1 0\n1 x\n", 2, "item id 0 is below 1", {}),  # the first bad line is the one named
]


@pytest.mark.parametrize("text, line_number, problem, kwargs", BAD_FILES, ids=[b[2][:40] for b in BAD_FILES])
def test_malformed_lines_name_the_file_the_line_and_the_problem(tmp_path, text, line_number, problem, kwargs):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(MalformedLineError) as caught:
        read_sequence_file(path, **kwargs)
    error = caught.value
    assert error.path == str(path) and error.line_number == line_number
    assert problem in error.problem
    assert str(error).startswith(f"{path}, line {line_number}: ") and problem in str(error)


def test_an_empty_file_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(ValueError, match="empty.txt has no lines"):
        read_sequence_file(path)


def test_the_data_module_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        SequenceFileDataModule(str(tmp_path / "missing.txt")).train_dataloader()


# ---------------------------------------------------------------------------------------------- split


def test_split_of_every_length_class_and_its_counts(tmp_path, caplog):
    dm = SequenceFileDataModule(str(_write(tmp_path / "s.txt", SMALL)), global_batch_size=1, shuffle=False, num_negatives=0)
    with caplog.at_level(logging.INFO, logger="lightning_recsys.data.sequences.split"):
        assert dm.users_without_eval == 2  # users 13 (2 items) and 14 (1 item)
        assert dm.users_without_train == 2  # users 12 (training part of 1 item) and 14
        assert dm.num_examples == {"train": 3, "val": 3, "test": 3}
        assert dm.evaluated_user_ids.tolist() == [11, 12, 15]
        dm.split  # noqa: B018 (read again: logged once)
    assert len([r for r in caplog.records if "have no validation or test example" in r.getMessage()]) == 1

    train = _all_examples(dm, "train")
    assert [(e["input"], e["next"]) for e in train] == [
        (_rows([1, 2, 3]), _rows([2, 3, 4])),  # user 11: trains on 1..4
        (_rows([10]), _rows([11])),  # user 13: fewer than 3 items, all train
        (_rows([13]), _rows([14])),  # user 15: trains on 13, 14
    ]
    assert all(e["seen"] == [] and e["negatives"] == [] for e in train)
    val = _all_examples(dm, "val")
    assert [(e["input"], e["next"], e["seen"]) for e in val] == [
        (_rows([1, 2, 3, 4]), _rows([2, 3, 4, 5]), _rows([1, 2, 3, 4])),
        (_rows([7]), _rows([8]), _rows([7])),  # user 12: 3 items, validated and tested, never trained
        (_rows([13, 14]), _rows([14, 15]), _rows([13, 14])),
    ]
    test = _all_examples(dm, "test")
    assert [(e["input"], e["next"], e["seen"]) for e in test] == [
        (_rows([1, 2, 3, 4, 5]), _rows([2, 3, 4, 5, 6]), _rows([1, 2, 3, 4, 5])),
        (_rows([7, 8]), _rows([8, 9]), _rows([7, 8])),
        (_rows([13, 14, 15]), _rows([14, 15, 16]), _rows([13, 14, 15])),
    ]
    assert all(e["negatives"] == [] for e in val + test)


def test_max_length_cuts_the_oldest_items_but_never_the_seen_ids(tmp_path):
    items = list(range(1, 13))  # train 1..10, val 11, test 12
    dm = SequenceFileDataModule(str(_write(tmp_path / "s.txt", {1: items})), max_length=3, global_batch_size=1, num_negatives=0)
    (train,) = _all_examples(dm, "train")
    assert train["input"] == _rows([7, 8, 9]) and train["next"] == _rows([8, 9, 10])
    (val,) = _all_examples(dm, "val")
    assert val["input"] == _rows([8, 9, 10]) and val["next"] == _rows([9, 10, 11]) and val["seen"] == _rows(items[:10])
    (test,) = _all_examples(dm, "test")
    assert test["input"] == _rows([9, 10, 11]) and test["next"] == _rows([10, 11, 12]) and test["seen"] == _rows(items[:11])


def _repeating_file(tmp_path: Path, seed: int = 0) -> tuple[Path, dict[int, list[int]]]:
    """Users of 1..12 items from a vocabulary of 6 ids (many repeats); each held-out item is a fresh id
    (>= 100, used once), so a leak shows as a value."""
    rng = np.random.default_rng(seed)
    sequences, fresh = {}, iter(range(100, 1000))
    for user in range(1, 41):
        n = int(rng.integers(1, 13))
        items = rng.integers(1, 7, n).tolist()
        if n >= 3:
            items[-2:] = [next(fresh), next(fresh)]
        sequences[user] = items
    return _write(tmp_path / "repeats.txt", sequences), sequences


@pytest.mark.parametrize("max_length", [2, 50])
def test_no_validation_or_test_item_reaches_training_and_no_test_item_reaches_validation(tmp_path, max_length):
    path, sequences = _repeating_file(tmp_path)
    held_val = {items[-2] - 1 for items in sequences.values() if len(items) >= 3}
    held_test = {items[-1] - 1 for items in sequences.values() if len(items) >= 3}
    dm = SequenceFileDataModule(str(path), max_length=max_length, global_batch_size=4, num_negatives=0, shuffle=True)
    dataset = dm._dataset("train", 0, 1)
    for _ in range(2):  # two shuffled epochs
        for batch in dataset:
            touched = set(batch.sparse[ITEM_FEATURE].values().tolist()) | set(batch.next_item_ids.tolist())
            assert not touched & (held_val | held_test)
    for batch in dm._dataset("val", 0, 1):
        assert not set(batch.sparse[ITEM_FEATURE].values().tolist()) & held_test
        assert not set(batch.seen_ids.tolist()) & held_test
        assert not set(batch.next_item_ids.tolist()) & held_test
    # The targets are the held-out items, each user's own (users in file order).
    evaluated = [items for items in sequences.values() if len(items) >= 3]
    assert [e["next"][-1] for e in _all_examples(dm, "val")] == [items[-2] - 1 for items in evaluated]
    assert [e["next"][-1] for e in _all_examples(dm, "test")] == [items[-1] - 1 for items in evaluated]


def test_every_example_is_its_users_prefix_with_repeated_items(tmp_path):
    path, sequences = _repeating_file(tmp_path, seed=1)
    dm = SequenceFileDataModule(str(path), global_batch_size=1, num_negatives=0, shuffle=False)
    trained = [items[:-2] if len(items) >= 3 else items for items in sequences.values()]
    trained = [_rows(items) for items in trained if len(items) >= 2]
    train = _all_examples(dm, "train")
    assert [e["input"] + e["next"][-1:] for e in train] == trained
    assert all(e["next"][:-1] == e["input"][1:] for e in train)  # next items are aligned with the input
    evaluated = [_rows(items) for items in sequences.values() if len(items) >= 3]
    assert [e["seen"] + e["next"][-1:] for e in _all_examples(dm, "val")] == [items[:-1] for items in evaluated]
    assert [e["seen"] + e["next"][-1:] for e in _all_examples(dm, "test")] == evaluated


def test_split_counts_on_a_direct_split(tmp_path):
    path, sequences = _repeating_file(tmp_path, seed=2)
    split = LeaveOneOutSplit(read_sequence_file(path))
    lengths = np.array([len(items) for items in sequences.values()])
    assert split.users_without_eval == int((lengths < 3).sum())
    assert split.users_without_train == int(((lengths < 2) | (lengths == 3)).sum())
    assert split.num_examples("train") == len(lengths) - split.users_without_train


# ---------------------------------------------------------------------------------------------- ranks and batches


def _global_view(batches_per_rank: list[list]) -> list[list[dict[str, list[int]]]]:
    """Global batch i as the concatenation of the ranks' batch i (negatives left out: they are per rank)."""
    lengths = {len(batches) for batches in batches_per_rank}
    assert len(lengths) == 1, f"ranks yielded different numbers of batches: {lengths}"
    view = []
    for per_rank in zip(*batches_per_rank):
        view.append([{k: v for k, v in e.items() if k != "negatives"} for batch in per_rank for e in _examples(batch)])
    return view


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_global_batches_do_not_depend_on_the_number_of_ranks(tmp_path, split):
    path, _ = _repeating_file(tmp_path, seed=3)
    dm = SequenceFileDataModule(str(path), max_length=4, global_batch_size=8, num_negatives=5, seed=7)
    one = _global_view([list(dm._dataset(split, 0, 1))])
    assert one, "the split yielded no batch"
    for world in (2, 4):
        assert _global_view([list(dm._dataset(split, rank, world)) for rank in range(world)]) == one
    again = SequenceFileDataModule(str(path), max_length=4, global_batch_size=8, num_negatives=5, seed=7)
    assert _global_view([list(again._dataset(split, 1, 2))]) == _global_view([list(dm._dataset(split, 1, 2))])


def test_a_partial_global_batch_is_dropped_in_training_and_kept_split_evenly_in_evaluation(tmp_path):
    sequences = {user: list(range(1, 7)) for user in range(1, 12)}  # 11 users, every one in every split
    dm = SequenceFileDataModule(str(_write(tmp_path / "s.txt", sequences)), global_batch_size=4, num_negatives=2)
    assert [len(list(dm._dataset("train", r, 2))) for r in (0, 1)] == [2, 2]  # 11 // 4; 3 examples dropped
    sizes = [[b.batch_size for b in dm._dataset("test", r, 2)] for r in (0, 1)]
    assert sizes == [[2, 2, 1], [2, 2, 2]]  # the last global batch of 3 is cut 1 + 2: every user is tested
    assert len(dm._dataset("test", 0, 2)) == 3 and len(dm._dataset("train", 0, 2)) == 2
    # A last global batch smaller than the world size leaves a rank an empty slice (the strategy skips that step).
    three = SequenceFileDataModule(str(_write(tmp_path / "three.txt", {1: [1, 2, 3], 2: [1, 2, 3], 3: [1, 2, 4]})), global_batch_size=2)
    assert [[b.batch_size for b in three._dataset("test", r, 2)] for r in (0, 1)] == [[1, 0], [1, 1]]


def test_training_order_is_shuffled_per_epoch_from_the_seed_and_resumes_at_the_trainers_epoch(tmp_path):
    path, _ = _repeating_file(tmp_path, seed=4)

    def epochs(seed: int, start_epoch: int = 0, count: int = 2):
        dataset = SequenceFileDataModule(str(path), global_batch_size=4, num_negatives=3, seed=seed)._dataset("train", 0, 1)
        dataset.epoch = start_epoch
        return [[(e["input"], e["negatives"]) for batch in dataset for e in _examples(batch)] for _ in range(count)]

    first, second = epochs(0)
    assert first != second
    assert epochs(0) == [first, second]  # deterministic
    assert epochs(0, start_epoch=1, count=1) == [second]  # a loader made at epoch 1 draws epoch 1's order
    assert epochs(1, count=1) != [first]
    unshuffled = SequenceFileDataModule(str(path), global_batch_size=4, num_negatives=0, shuffle=False)._dataset("train", 0, 1)
    # Without shuffle, epochs 0 and 1 come in the same (file) order.
    assert [b.sparse[ITEM_FEATURE].values().tolist() for b in unshuffled] == [b.sparse[ITEM_FEATURE].values().tolist() for b in unshuffled]


# ---------------------------------------------------------------------------------------------- negatives


@pytest.mark.parametrize("num_negatives, local_batch", [(10, 4), (3, 4), (8, 4), (0, 4)])
def test_negatives_are_spread_ceil_then_floor_over_the_local_examples(tmp_path, num_negatives, local_batch):
    sequences = {user: [1, 2, 3, 4, 5] for user in range(1, 17)}
    dm = SequenceFileDataModule(str(_write(tmp_path / "s.txt", sequences)), global_batch_size=2 * local_batch, num_negatives=num_negatives)
    for rank in (0, 1):
        for batch in dm._dataset("train", rank, 2):
            lengths = batch.sparse[NEGATIVE_FEATURE].lengths().tolist()
            ceil, floor = -(-num_negatives // local_batch), num_negatives // local_batch
            assert lengths == [ceil] * (num_negatives % local_batch) + [floor] * (local_batch - num_negatives % local_batch)
            assert sum(lengths) == num_negatives


def test_negatives_are_uniform_over_every_row_and_seeded_per_batch_rank_and_epoch(tmp_path):
    num_items = 10
    sequences = {user: [1, 2, 3, 4, num_items] for user in range(1, 9)}
    path = str(_write(tmp_path / "s.txt", sequences))
    dm = SequenceFileDataModule(path, global_batch_size=4, num_negatives=20_000)
    dataset = dm._dataset("train", 0, 2)
    pools = [batch.sparse[NEGATIVE_FEATURE].values() for batch in dataset]
    counts = torch.bincount(torch.cat(pools), minlength=num_items)
    assert len(counts) == num_items  # nothing outside [0, num_items)
    expected = sum(len(p) for p in pools) / num_items
    assert (counts - expected).abs().max() < 5 * expected**0.5, counts  # every row, row 0 and the last one included
    assert not torch.equal(pools[0], pools[1])  # another batch, another pool
    other_rank = [batch.sparse[NEGATIVE_FEATURE].values() for batch in dm._dataset("train", 1, 2)]
    assert not torch.equal(pools[0], other_rank[0])
    next_epoch = [batch.sparse[NEGATIVE_FEATURE].values() for batch in dataset]
    assert not torch.equal(pools[0], next_epoch[0])
    same = SequenceFileDataModule(path, global_batch_size=4, num_negatives=20_000)._dataset("train", 0, 2)
    assert all(torch.equal(a, b) for a, b in zip(pools, [batch.sparse[NEGATIVE_FEATURE].values() for batch in same]))


def test_all_negatives_is_every_row_of_the_table_in_training_only(tmp_path):
    sequences = {user: [1, 2, 3, 4, 5] for user in range(1, 9)}
    dm = SequenceFileDataModule(str(_write(tmp_path / "s.txt", sequences)), global_batch_size=4, num_negatives="all", num_items=7)
    for batch in dm._dataset("train", 1, 2):
        negatives = batch.sparse[NEGATIVE_FEATURE]
        assert negatives.values().tolist() == list(range(7)) and negatives.lengths().tolist() == [4, 3]
    for split in ("val", "test"):
        for batch in dm._dataset(split, 0, 2):
            assert batch.sparse[NEGATIVE_FEATURE].lengths().tolist() == [0, 0]
            assert batch.seen_lengths.tolist() == ([3, 3] if split == "val" else [4, 4])


# ---------------------------------------------------------------------------------------------- the DataModule


def test_num_items_defaults_to_the_largest_id_and_actions_ride_with_the_items(tmp_path):
    path = _write(tmp_path / "a.txt", {1: [4, 5, 6, 9]}, actions={1: [2, 0, 1, 1]})
    dm = SequenceFileDataModule(str(path), num_action_types=3, global_batch_size=1, num_negatives=2)
    assert dm.num_items == 9 and dm.num_action_types == 3
    (batch,) = list(dm._dataset("train", 0, 1))
    assert batch.sparse.keys() == [ITEM_FEATURE, NEXT_ITEM_FEATURE, ACTION_FEATURE, NEGATIVE_FEATURE]
    assert torch.equal(batch.sparse[NEXT_ITEM_FEATURE].values(), batch.next_item_ids)
    assert batch.sparse[ACTION_FEATURE].values().tolist() == [2]  # the input [4] of the training part [4, 5]
    assert torch.equal(batch.sparse[ACTION_FEATURE].lengths(), batch.sparse[ITEM_FEATURE].lengths())
    assert SequenceFileDataModule(str(path), num_items=20, num_action_types=3).num_items == 20
    plain = SequenceFileDataModule(str(_write(tmp_path / "p.txt", {1: [1, 2, 3]})), global_batch_size=1)
    assert plain.num_action_types == 0
    assert next(iter(plain._dataset("test", 0, 1))).sparse.keys() == [ITEM_FEATURE, NEXT_ITEM_FEATURE, NEGATIVE_FEATURE]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_negatives": -1}, "num_negatives=-1 must be an integer >= 0 or 'all'"),
        ({"num_negatives": "some"}, "num_negatives='some'"),
        ({"max_length": 0}, "max_length=0 must be an integer >= 1"),
        ({"global_batch_size": 0}, "global_batch_size=0 must be an integer >= 1"),
        ({"num_items": 0}, "num_items=0 must be an integer >= 1"),
        ({"num_action_types": -1}, "num_action_types=-1 must be an integer >= 0"),
        ({"shuffle": "yes"}, "shuffle='yes' must be true or false"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SequenceFileDataModule(str(tmp_path / "s.txt"), **kwargs)


def test_a_global_batch_not_divisible_by_the_world_size_is_refused(tmp_path):
    dm = SequenceFileDataModule(str(_write(tmp_path / "s.txt", SMALL)), global_batch_size=3)
    with pytest.raises(ValueError, match="global_batch_size=3 is not divisible by the world size 2"):
        dm._dataset("train", 0, 2)


def test_the_loaders_take_rank_world_size_and_epoch_from_the_trainer(tmp_path):
    path, _ = _repeating_file(tmp_path, seed=5)
    dm = SequenceFileDataModule(str(path), global_batch_size=4, num_negatives=3)
    dm.trainer = SimpleNamespace(global_rank=1, world_size=2, current_epoch=2)
    loader = dm.train_dataloader()
    assert (loader.dataset.rank, loader.dataset.world_size, loader.dataset.epoch) == (1, 2, 2)
    expected = dm._dataset("train", 1, 2)
    expected.epoch = 2
    assert [_examples(b) for b in loader] == [_examples(b) for b in expected]
    assert dm.predict_dataloader().dataset.split == "test"

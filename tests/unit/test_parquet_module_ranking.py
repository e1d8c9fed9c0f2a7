"""SequenceParquetRankingDataModule: the text path's DIN pairs from a prepared directory, every evaluated user once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_recsys.contracts.names import CANDIDATE_ITEM_FEATURE, HISTORY_ITEM_FEATURE
from lightning_recsys.data.parquet.ranking import SequenceParquetRankingDataModule
from lightning_recsys.data.parquet.writing import PreparedWriter
from lightning_recsys.data.sequences import SequenceFileRankingDataModule

NUM_ITEMS = 80


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranking")
    rng = np.random.default_rng(2)
    lengths = rng.choice([1, 2, 3, 5, 8, 13], size=57)
    items = rng.integers(0, NUM_ITEMS, size=int(lengths.sum()))
    writer = PreparedWriter(root / "prepared", NUM_ITEMS, groups_per_file=2)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for lo, hi in ((0, 20), (20, 31), (31, 57)):
        writer.write_group(np.arange(lo, hi) + 1, lengths[lo:hi], items[offsets[lo] : offsets[hi]])
    writer.close()
    lines = [f"{user + 1} {items[p] + 1}" for user in range(len(lengths)) for p in range(offsets[user], offsets[user + 1])]
    (root / "events.txt").write_text("\n".join(lines) + "\n")
    return root, lengths


@pytest.mark.parametrize("split", ["val", "test"])
def test_one_process_gives_the_text_paths_histories_and_positives(both, split):
    root, _ = both
    text = SequenceFileRankingDataModule(str(root / "events.txt"), num_items=NUM_ITEMS, max_history=4, global_batch_size=8)
    parquet = SequenceParquetRankingDataModule(str(root / "prepared"), max_history=4, global_batch_size=8)
    assert parquet.num_items == NUM_ITEMS
    expected, actual = list(text._dataset(split, 0, 1)), list(parquet._dataset(split, 0, 1))

    def flat(batches, key):
        return torch.cat([b.sparse[key].values() for b in batches]), torch.cat([b.sparse[key].lengths() for b in batches])

    for a, b in zip(flat(expected, HISTORY_ITEM_FEATURE), flat(actual, HISTORY_ITEM_FEATURE)):
        assert torch.equal(a, b)
    positives = [flat(batches, CANDIDATE_ITEM_FEATURE)[0][0::2] for batches in (expected, actual)]
    assert torch.equal(*positives)
    assert torch.equal(torch.cat([b.labels for b in actual]), torch.tensor([1.0, 0.0]).repeat(len(positives[0])))


def test_two_ranks_evaluate_every_user_with_three_events_once_in_equally_many_batches(both):
    root, lengths = both
    parquet = SequenceParquetRankingDataModule(str(root / "prepared"), global_batch_size=8)
    batches = [list(parquet._dataset("test", rank, 2)) for rank in range(2)]
    assert len(batches[0]) == len(batches[1]) and all(b.batch_size > 0 for r in batches for b in r)
    assert sum(b.batch_size for r in batches for b in r) == 2 * int((lengths >= 3).sum())


def test_training_batches_hold_whole_pairs_of_the_local_size(both):
    root, _ = both
    parquet = SequenceParquetRankingDataModule(str(root / "prepared"), global_batch_size=8, train_user_fraction=0.5)
    batches = list(parquet._dataset("train", 1, 2))
    assert batches and all(b.batch_size == 4 and b.labels.tolist() == [1.0, 0.0, 1.0, 0.0] for b in batches)
    with pytest.raises(ValueError, match="global_batch_size=6 must be a multiple of 2 x the world size 2"):
        SequenceParquetRankingDataModule(str(root / "prepared"), global_batch_size=6)._dataset("train", 0, 2)

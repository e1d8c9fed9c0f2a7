"""Synthetic pretraining sequences: the planted successor chains, their best hit rate, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_recsys.data import SyntheticPretrainDataModule
from lightning_recsys.data.sequences import ACTION_FEATURE, ITEM_FEATURE, NEGATIVE_FEATURE, NEXT_ITEM_FEATURE


def _test_examples(dm: SyntheticPretrainDataModule) -> list[tuple[list[int], int, list[int]]]:
    """(input, target, seen) of every test example."""
    out = []
    for batch in dm._dataset("test", 0, 1):
        items = batch.sparse[ITEM_FEATURE]
        inputs = torch.split(items.values(), items.lengths().tolist())
        nexts = torch.split(batch.next_item_ids, items.lengths().tolist())
        seen = torch.split(batch.seen_ids, batch.seen_lengths.tolist())
        out += [(i.tolist(), int(n[-1]), s.tolist()) for i, n, s in zip(inputs, nexts, seen)]
    return out


def test_same_seed_same_sequences_and_another_seed_others():
    a, b, c = SyntheticPretrainDataModule(seed=3), SyntheticPretrainDataModule(seed=3), SyntheticPretrainDataModule(seed=4)
    assert np.array_equal(a.sequences.items, b.sequences.items) and np.array_equal(a.sequences.offsets, b.sequences.offsets)
    assert not np.array_equal(a.sequences.items[:100], c.sequences.items[:100])


def test_users_stay_in_one_cluster_and_mostly_follow_the_successor():
    dm = SyntheticPretrainDataModule(num_users=2000, num_items=120, num_clusters=3, jump_probability=0.3, seed=1)
    sequences, chains = dm.sequences, dm.chains
    lengths = sequences.lengths
    assert lengths.min() >= dm.min_sequence_length and lengths.max() <= dm.max_sequence_length
    followed = total = 0
    for u in range(sequences.num_users):
        items = sequences.items[sequences.offsets[u] : sequences.offsets[u + 1]]
        assert len(set(chains.cluster_of_row[items].tolist())) == 1
        followed += int((chains.successor[items[:-1]] == items[1:]).sum())
        total += len(items) - 1
    size = dm.num_items // dm.num_clusters
    expected = 1 - dm.jump_probability + dm.jump_probability / size  # a jump may land on the successor too
    assert abs(followed / total - expected) < 0.02, (followed / total, expected)
    # Successors form one cycle per cluster: every row is exactly one row's successor.
    assert sorted(chains.successor.tolist()) == list(range(dm.num_items))


def test_the_best_ranking_reaches_the_documented_hit_rate_far_above_popularity():
    dm = SyntheticPretrainDataModule(num_users=3000, seed=2, global_batch_size=100)
    examples = _test_examples(dm)
    chains = dm.chains
    # The best ranking: the successor of the last input item, then the rest of its cluster.
    k = 10
    hits = []
    for inputs, target, _ in examples:
        last = inputs[-1]
        first = int(chains.successor[last])
        cluster = chains.rows[chains.cluster_of_row[last]]
        others = [int(r) for r in cluster if r != first]
        ranking = [first] + others[: k - 1]  # any k - 1 others of the cluster: they are equally likely
        hits.append(target in ranking)
    assert abs(np.mean(hits) - dm.expected_hit_rate(k)) < 0.03, (np.mean(hits), dm.expected_hit_rate(k))
    # Most popular in training, seen items filtered.
    counts = np.bincount(dm.sequences.items, minlength=dm.num_items)
    popular = np.argsort(-counts, kind="stable")
    popular_hits = [target in [r for r in popular.tolist() if r not in set(seen)][:k] for _, target, seen in examples]
    assert np.mean(popular_hits) < 0.1 < dm.expected_hit_rate(k) - 0.5


def test_batches_carry_actions_and_negatives_from_the_item_table():
    dm = SyntheticPretrainDataModule(num_users=64, num_items=40, num_clusters=2, num_action_types=3, num_negatives=10, global_batch_size=8)
    for batch in dm._dataset("train", 1, 2):
        kjt = batch.sparse
        assert kjt.keys() == [ITEM_FEATURE, NEXT_ITEM_FEATURE, ACTION_FEATURE, NEGATIVE_FEATURE]
        assert kjt[ACTION_FEATURE].values().max() < 3 and kjt[NEGATIVE_FEATURE].values().max() < 40
        assert kjt[NEGATIVE_FEATURE].lengths().tolist() == [3, 3, 2, 2]
    assert dm.num_items == 40 and dm.num_action_types == 3
    assert dm.users_without_eval == 0 and dm.users_without_train == 0  # sequences of 8 or more


def test_transitions_counted_on_the_training_batches_alone_nearly_reach_the_best_hit_rate():
    # Learnable from the training split: a bigram table of (input item -> next item) counts, read off the
    # training batches only, ranks the test targets almost as well as the planted chains do.
    dm = SyntheticPretrainDataModule(seed=5)
    counts = np.zeros((dm.num_items, dm.num_items))
    for batch in dm._dataset("train", 0, 1):
        np.add.at(counts, (batch.sparse[ITEM_FEATURE].values().numpy(), batch.next_item_ids.numpy()), 1)
    k, hits = 10, []
    for inputs, target, seen in _test_examples(dm):
        scores = counts[inputs[-1]] + 1e-3 * np.random.default_rng(0).random(dm.num_items)  # random tie-break
        scores[[s for s in seen if s != target]] = -np.inf
        hits.append(target in np.argsort(-scores)[:k].tolist())
    assert np.mean(hits) > dm.expected_hit_rate(k) - 0.08, (np.mean(hits), dm.expected_hit_rate(k))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_items": 250, "num_clusters": 4}, "num_items=250 must be a multiple of num_clusters=4"),
        ({"jump_probability": 1.5}, "jump_probability=1.5 must be a probability"),
        ({"min_sequence_length": 10, "max_sequence_length": 5}, "max_sequence_length=5 must be an integer >= 10"),
        ({"num_users": 0}, "num_users=0 must be an integer >= 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticPretrainDataModule(**kwargs)

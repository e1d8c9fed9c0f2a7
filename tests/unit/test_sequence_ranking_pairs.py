"""DIN-style implicit-feedback pairs from a sequence file: positives at every training position and the
leave-one-out targets, negatives never touched by the user and fixed by the seed in evaluation."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_recsys.data import SequenceFileRankingDataModule
from lightning_recsys.models import SequenceRanker
from lightning_recsys.models.encoders import SASRecEncoder

ITEMS = 30


def _write(path: Path, seed: int = 0) -> dict[int, list[int]]:
    """Users 1..12 with 1 to 9 distinct items each (file ids from 1), one 'user item' line per interaction; user 12
    touched every item but one (its negatives have one choice)."""
    rng = np.random.default_rng(seed)
    sequences = {u: (rng.choice(ITEMS, size=int(rng.integers(1, 10)), replace=False) + 1).tolist() for u in range(1, 12)}
    sequences[12] = (rng.permutation(ITEMS - 1) + 1).tolist()  # every item but the last
    path.write_text("".join(f"{u} {i}\n" for u, items in sequences.items() for i in items))
    return sequences


def _module(path: Path, **overrides: object) -> SequenceFileRankingDataModule:
    return SequenceFileRankingDataModule(**{"path": str(path), "num_items": ITEMS, "max_history": 3, "global_batch_size": 4, **overrides})  # type: ignore[arg-type]


def _examples(dm: SequenceFileRankingDataModule, split: str, rank: int = 0, world_size: int = 1) -> list[tuple[list[int], int, float]]:
    """(history, candidate, label) of every example, 1-based ids."""
    out = []
    for batch in dm._dataset(split, rank, world_size):  # type: ignore[arg-type]
        history = batch.sparse["history_item_id"]
        parts = history.values().split(history.lengths().tolist())
        for h, c, y in zip(parts, batch.sparse["candidate_item_id"].values().tolist(), batch.labels.tolist()):
            out.append(((h + 1).tolist(), c + 1, y))
    return out


def test_pairs_follow_the_protocol_and_negatives_were_never_touched(tmp_path):
    sequences = _write(tmp_path / "seq.txt")
    dm = _module(tmp_path / "seq.txt", global_batch_size=2)  # one pair per batch: none dropped
    touched_by_history = {}
    expected: dict[str, list[tuple[list[int], int]]] = {"train": [], "val": [], "test": []}
    for items in sequences.values():
        n = len(items)
        train = n - 2 if n >= 3 else n
        expected["train"] += [(items[max(0, p - 3) : p], items[p]) for p in range(1, train)]
        if n >= 3:
            expected["val"].append((items[max(0, n - 5) : n - 2], items[n - 2]))
            expected["test"].append((items[max(0, n - 4) : n - 1], items[n - 1]))
    for split in ("train", "val", "test"):
        examples = _examples(dm, split)
        positives, negatives = examples[0::2], examples[1::2]
        assert [y for _, _, y in positives] == [1.0] * len(positives) and [y for _, _, y in negatives] == [0.0] * len(negatives)
        assert sorted((h, c) for h, c, _ in positives) == sorted(expected[split]), split
        for (history, positive, _), (negative_history, negative, _) in zip(positives, negatives, strict=True):
            assert history == negative_history  # the pair shares its history
            # Every user whose sequence has this point (history then positive): none of them touched the negative.
            users = [u for u, items in sequences.items() if positive in items and items[max(0, items.index(positive) - 3) : items.index(positive)] == history]
            assert users and all(negative not in sequences[u] for u in users), (split, users, negative)
            if users == [12]:
                assert negative == ITEMS
                touched_by_history[split] = True
    assert touched_by_history == {"train": True, "val": True, "test": True}


def test_evaluation_pairs_are_fixed_by_the_seed_on_any_world_size(tmp_path):
    _write(tmp_path / "seq.txt")
    one = _examples(_module(tmp_path / "seq.txt"), "test")
    again = _examples(_module(tmp_path / "seq.txt"), "test")
    assert one == again
    dm = _module(tmp_path / "seq.txt")
    by_rank = [_examples(dm, "test", rank, 2) for rank in range(2)]
    # Global batch i of 2 pairs: rank 0 has its first pair, rank 1 its second.
    merged = [e for i in range(0, len(one), 4) for e in by_rank[0][i // 2 : i // 2 + 2] + by_rank[1][i // 2 : i // 2 + 2]]
    assert merged == one
    other = _examples(_module(tmp_path / "seq.txt", seed=1), "test")
    assert [e for e in one[0::2]] == [e for e in other[0::2]] and one[1::2] != other[1::2]  # same positives, other negatives
    dataset = _module(tmp_path / "seq.txt")._dataset("train", 0, 1)
    first, second = ([b.sparse["candidate_item_id"].values() for b in dataset] for _ in range(2))
    assert not all(torch.equal(a, b) for a, b in zip(first, second))  # a new epoch draws new negatives (and order)


def test_train_user_fraction_keeps_evaluation_whole_and_batches_feed_the_ranker(tmp_path):
    _write(tmp_path / "seq.txt")
    full, part = _module(tmp_path / "seq.txt"), _module(tmp_path / "seq.txt", train_user_fraction=0.25)
    assert part.pairs.num_pairs("train") < full.pairs.num_pairs("train")
    assert part.pairs.num_pairs("test") == full.pairs.num_pairs("test")
    model = SequenceRanker(item_table_size=ITEMS, num_action_types=0, embedding_dim=8, max_history=4, encoder=partial(SASRecEncoder, num_heads=2))
    batch = next(iter(full._dataset("train", 0, 1)))
    assert model.training_losses(batch)["loss"].isfinite()
    with pytest.raises(ValueError, match=r"train_user_fraction=0 must be a number in \(0, 1\]"):
        _module(tmp_path / "seq.txt", train_user_fraction=0)
    with pytest.raises(ValueError, match=r"global_batch_size=6 must be a multiple of 2 x the world size 2"):
        full._dataset("train", 0, 2).__class__(full.pairs, "train", rank=0, world_size=2, global_batch_size=6, max_history=3, shuffle=True, seed=0)
    assert torch.equal(batch.labels[:2], torch.tensor([1.0, 0.0]))

"""The full ranking's pieces, without a process group: the reference against a ranking written out by hand,
chunking and its memory bound, the top-K merge, the input checks, and the plain-module paths (unsharded,
replicated) of ``make_item_ranking``, ``ShardedItemRanking`` and ``TwoDRecStrategy.item_ranking``."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torchrec import EmbeddingCollection, EmbeddingConfig

from lightning_recsys import TwoDRecStrategy
from lightning_recsys.parallel.ranking import (
    ShardedItemRanking,
    UnshardedItemRanking,
    make_item_ranking,
    merge_top_k,
    seen_mask,
)

NUM_ITEMS, DIM = 23, 4


def _inputs(seed: int, batch: int = 6, integer: bool = False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randint(-2, 3, (batch, DIM), generator=generator).float() if integer else torch.randn(batch, DIM, generator=generator)
    targets = torch.randint(0, NUM_ITEMS, (batch,), generator=generator)
    lengths = torch.randint(0, 5, (batch,), generator=generator)
    seen = torch.randint(0, NUM_ITEMS, (int(lengths.sum()),), generator=generator)
    if batch and lengths[0]:
        seen[0] = targets[0]
    return {"queries": queries, "target_ids": targets, "seen_ids": seen, "seen_lengths": lengths}


def _table(seed: int, integer: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if integer:  # few distinct rows of small integers: exact scores, many ties
        return torch.randint(-1, 2, (4, DIM), generator=generator).float()[torch.randint(0, 4, (NUM_ITEMS,), generator=generator)]
    return torch.randn(NUM_ITEMS, DIM, generator=generator)


def _by_hand(table: torch.Tensor, inputs: dict[str, torch.Tensor], k: int) -> tuple[list[int], list[list[int]]]:
    """Per user, one item at a time: the protocol as the module docstring states it."""
    ranks, tops = [], []
    start = 0
    for user, length in enumerate(inputs["seen_lengths"].tolist()):
        seen = set(inputs["seen_ids"][start : start + length].tolist())
        start += length
        query, target = inputs["queries"][user], int(inputs["target_ids"][user])
        scores = [float((query * table[item]).sum()) for item in range(NUM_ITEMS)]
        ranks.append(sum(1 for item in range(NUM_ITEMS) if item != target and item not in seen and scores[item] >= scores[target]))
        unseen = sorted((item for item in range(NUM_ITEMS) if item not in seen), key=lambda item: (-scores[item], item))
        tops.append(unseen[:k])
    return ranks, tops


@pytest.mark.parametrize("integer", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("chunk_rows", [1, 3, 1000])
def test_the_reference_ranks_as_written_out_by_hand(integer: bool, chunk_rows: int) -> None:
    table, inputs = _table(1, integer), _inputs(2, integer=integer)
    ranking = UnshardedItemRanking(table, chunk_rows=chunk_rows)
    expected_ranks, expected_tops = _by_hand(table, inputs, k=5)
    assert ranking.target_ranks(**inputs).tolist() == expected_ranks
    seen = (inputs["seen_ids"], inputs["seen_lengths"])
    scores, ids = ranking.top_k(inputs["queries"], 5, *seen)
    assert ids.tolist() == expected_tops
    torch.testing.assert_close(scores, (inputs["queries"][:, None, :] * table[ids]).sum(-1))


def test_ties_count_against_the_target() -> None:
    table = torch.ones(NUM_ITEMS, DIM)  # every item scores alike: the target ranks last among the unseen
    inputs = {"queries": torch.ones(2, DIM), "target_ids": torch.tensor([0, 5])}
    inputs.update(seen_ids=torch.tensor([1, 2, 5]), seen_lengths=torch.tensor([0, 3]))
    ranks = UnshardedItemRanking(table).target_ranks(**inputs)
    assert ranks.tolist() == [NUM_ITEMS - 1, NUM_ITEMS - 3]  # user 1's seen target is still ranked; its seen items do not count
    _, ids = UnshardedItemRanking(table).top_k(inputs["queries"], 3, inputs["seen_ids"], inputs["seen_lengths"])
    assert ids.tolist() == [[0, 1, 2], [0, 3, 4]]  # equal scores: lower ids first


def test_a_table_smaller_than_k_gives_every_item_and_seen_ones_last() -> None:
    table, inputs = _table(3), _inputs(4, batch=3)
    scores, ids = UnshardedItemRanking(table).top_k(inputs["queries"], NUM_ITEMS + 4, inputs["seen_ids"], inputs["seen_lengths"])
    assert ids.shape == (3, NUM_ITEMS)
    start = 0
    for user, length in enumerate(inputs["seen_lengths"].tolist()):
        seen = set(inputs["seen_ids"][start : start + length].tolist())
        start += length
        unseen = NUM_ITEMS - len(seen)
        assert set(ids[user, unseen:].tolist()) == seen and bool(torch.isinf(scores[user, unseen:]).all())


class _ScoreShapes(TorchFunctionMode):
    """Records the shape of every matrix product (the score blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        if func in (torch.mm, torch.matmul, torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.__matmul__):
            self.shapes.append(tuple(result.shape))
        return result


def test_chunking_bounds_the_score_block_and_changes_no_result() -> None:
    table, inputs = _table(5), _inputs(6, batch=7)
    seen = (inputs["seen_ids"], inputs["seen_lengths"])
    whole = UnshardedItemRanking(table, chunk_rows=NUM_ITEMS)
    chunked = UnshardedItemRanking(table, chunk_rows=3)
    with _ScoreShapes() as recorded:
        ranks = chunked.target_ranks(**inputs)
        scores, ids = chunked.top_k(inputs["queries"], 4, *seen)
    assert recorded.shapes and max(columns for _, columns in recorded.shapes) == 3  # never [queries x all rows]
    assert len(recorded.shapes) == 2 * -(-NUM_ITEMS // 3)
    assert torch.equal(ranks, whole.target_ranks(**inputs))
    whole_scores, whole_ids = whole.top_k(inputs["queries"], 4, *seen)
    assert torch.equal(ids, whole_ids)
    torch.testing.assert_close(scores, whole_scores)


def test_normalize_rows_scores_the_unit_rows() -> None:
    table, inputs = _table(7) * torch.arange(1, NUM_ITEMS + 1)[:, None], _inputs(8)
    normalised = UnshardedItemRanking(table / table.norm(dim=1, keepdim=True))
    ranking = UnshardedItemRanking(table, normalize_rows=True)
    assert torch.equal(ranking.target_ranks(**inputs), normalised.target_ranks(**inputs))
    assert not torch.equal(ranking.target_ranks(**inputs), UnshardedItemRanking(table).target_ranks(**inputs))


def test_merge_top_k_orders_by_score_then_lower_id() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, -torch.inf, 2.0]])
    ids = torch.tensor([[9, 7, 4, 0, 8]])
    merged_scores, merged_ids = merge_top_k(scores, ids, 4)
    assert merged_ids.tolist() == [[4, 7, 8, 9]] and merged_scores.tolist() == [[3.0, 3.0, 2.0, 1.0]]


def test_seen_mask_with_users_who_saw_nothing() -> None:
    mask = seen_mask(torch.tensor([4, 6, 5]), torch.tensor([0, 2, 0, 1]), row_start=4, num_rows=2, batch_size=4)
    assert mask.tolist() == [[False, False], [True, False], [False, False], [False, True]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda i: i.update(queries=torch.zeros(6, DIM + 1)), "queries must be"),
        (lambda i: i.update(target_ids=torch.tensor([0, 1])), "target_ids must be"),
        (lambda i: i.update(target_ids=torch.full((6,), NUM_ITEMS)), "outside the table's rows"),
        (lambda i: i.update(seen_ids=torch.tensor([-1] * int(i["seen_lengths"].sum()))), "outside the table's rows"),
        (lambda i: i.update(seen_ids=torch.tensor([1])), "sum\\(seen_lengths\\)"),
        (lambda i: i.update(seen_lengths=torch.tensor([1])), "seen_lengths must be"),
    ],
)
def test_bad_inputs_are_named(change, message: str) -> None:  # type: ignore[no-untyped-def]
    inputs = _inputs(9)
    change(inputs)
    with pytest.raises(ValueError, match=message):
        UnshardedItemRanking(_table(9)).target_ranks(**inputs)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="chunk_rows=0"):
        UnshardedItemRanking(_table(1), chunk_rows=0)
    with pytest.raises(ValueError, match="k=0"):
        UnshardedItemRanking(_table(1)).top_k(torch.zeros(1, DIM), 0, torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"table must be \[num_items, dim\]"):
        UnshardedItemRanking(torch.zeros(3))


def _collection() -> EmbeddingCollection:
    collection = EmbeddingCollection(
        tables=[EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=NUM_ITEMS, feature_names=[f"f_{n}"]) for n in ("item", "other")]
    )
    with torch.no_grad():
        collection.embeddings["item"].weight.copy_(_table(11))
    return collection


def _same_ranking(ranking, table: torch.Tensor, normalize_rows: bool) -> None:  # type: ignore[no-untyped-def]
    inputs = _inputs(12)
    reference = UnshardedItemRanking(table, normalize_rows=normalize_rows)
    assert torch.equal(ranking.target_ranks(**inputs), reference.target_ranks(**inputs))
    seen = (inputs["seen_ids"], inputs["seen_lengths"])
    scores, ids = ranking.top_k(inputs["queries"], 5, *seen)
    expected_scores, expected_ids = reference.top_k(inputs["queries"], 5, *seen)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(scores, expected_scores)  # a matrix product's last bit depends on the chunk's shape


@pytest.mark.parametrize("normalize_rows", [False, True])
def test_a_plain_collection_is_ranked_by_the_reference(normalize_rows: bool) -> None:
    collection = _collection()
    ranking = make_item_ranking(collection, "item", chunk_rows=5, normalize_rows=normalize_rows)
    assert isinstance(ranking, UnshardedItemRanking)
    _same_ranking(ranking, _table(11), normalize_rows)


def test_a_table_held_whole_needs_no_process_group() -> None:
    # What a data-parallel table reads as: a plain tensor in the state dict, ranked locally with no collective.
    ranking = ShardedItemRanking(_collection(), "item", process_group=None, chunk_rows=4)
    _same_ranking(ranking, _table(11), normalize_rows=False)


def test_the_strategy_ranks_an_unsharded_module_over_its_weight() -> None:
    ranking = TwoDRecStrategy().item_ranking(_collection(), "item", normalize_rows=True, chunk_rows=7)
    assert isinstance(ranking, UnshardedItemRanking) and ranking.chunk_rows == 7
    _same_ranking(ranking, _table(11), normalize_rows=True)


def test_an_unknown_table_is_named_with_the_tables_there_are() -> None:
    with pytest.raises(ValueError, match=r"table_name='items'.*\['item', 'other'\]"):
        make_item_ranking(_collection(), "items")


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_a_chunks_candidates_are_its_best_k_by_score_then_lower_id(k: int) -> None:
    # Few distinct scores and seen items at -inf: ties at the k-th score, where torch.topk alone could pick any.
    from lightning_recsys.parallel.ranking.unsharded import SeenItems, chunk_candidates

    generator = torch.Generator().manual_seed(k)
    queries, rows = torch.ones(5, 1), torch.randint(0, 3, (11, 1), generator=generator).float()
    seen = SeenItems.from_jagged(torch.randint(20, 31, (10,), generator=generator), torch.tensor([0, 2, 8, 0, 0]))
    scores, ids = chunk_candidates(queries, rows, 20, seen, k)
    all_scores, all_ids = chunk_candidates(queries, rows, 20, seen, 11)  # the whole chunk
    expected_scores, expected_ids = merge_top_k(all_scores, all_ids, k)
    assert ids.shape == (5, k)
    got_scores, got_ids = merge_top_k(scores, ids, k)
    assert torch.equal(got_ids, expected_ids) and torch.equal(got_scores, expected_scores)

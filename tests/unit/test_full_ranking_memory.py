"""The full ranking's memory bound and its running top-K, without a process group: a chunk's scores stay within
``block_bytes`` for any number of queries, a whole call allocates about one score block, and the threshold
top-K equals a full sort of every score (random scores, planted ties, a query that ties everything)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

from lightning_recsys.parallel.ranking import UnshardedItemRanking, merge_top_k
from lightning_recsys.parallel.ranking.chunks import MAX_CHUNK_ROWS, RunningTopK, SeenItems, rows_per_chunk

DIM = 8


def _inputs(num_items: int, batch: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (batch,), generator=generator)
    return {
        "queries": torch.randn(batch, DIM, generator=generator),
        "target_ids": torch.randint(0, num_items, (batch,), generator=generator),
        "seen_ids": torch.randint(0, num_items, (int(lengths.sum()),), generator=generator),
        "seen_lengths": lengths,
    }


class _ScoreBlocks(TorchFunctionMode):
    """The bytes of the largest matrix product (a chunk's score block) computed inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        if func in (torch.mm, torch.matmul, torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.__matmul__):
            self.largest = max(self.largest, result.numel() * result.element_size())
        return result


def _peak_allocated_bytes(call) -> int:  # type: ignore[no-untyped-def]
    """The most bytes torch held allocated at once during ``call()``, beyond what it held before: the profiler's
    allocation and free events replayed in order (conversions inside an operator count too)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        call()
    events = sorted((e for e in recorded.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    assert events, "the profiler recorded no allocation"
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_rows_per_chunk_bounds_the_score_bytes_and_the_rows() -> None:
    assert rows_per_chunk(1000, 4, 65_536, 16 * 2**20) == 4194  # 16 MiB / (1,000 x 4 bytes)
    assert rows_per_chunk(8, 4, 65_536, 16 * 2**20) == 65_536  # few queries: chunk_rows caps it
    assert rows_per_chunk(0, 4, 100, 10) == 2  # no queries: as one
    assert rows_per_chunk(10**6, 4, 100, 16) == 1  # never below one row
    assert rows_per_chunk(1, 4, 2**30, 2**40) == MAX_CHUNK_ROWS  # a float32 count of 0/1 stays exact


@pytest.mark.parametrize("batch", [3, 64, 200])
def test_no_score_block_exceeds_block_bytes_whatever_the_number_of_queries(batch: int) -> None:
    table, inputs = torch.randn(3000, DIM, generator=torch.Generator().manual_seed(1)), _inputs(3000, batch, batch)
    seen = (inputs["seen_ids"], inputs["seen_lengths"])
    block_bytes = 24_000  # 30 rows for 200 queries, 93 for 64, the chunk_rows cap of 500 for 3
    bounded = UnshardedItemRanking(table, chunk_rows=500, block_bytes=block_bytes)
    with _ScoreBlocks() as blocks:
        ranks = bounded.target_ranks(**inputs)
        scores, ids = bounded.top_k(inputs["queries"], 7, *seen)
    assert 0 < blocks.largest <= block_bytes
    assert blocks.largest >= batch * 4 * min(500, block_bytes // (batch * 4))  # the chunks are as large as allowed
    whole = UnshardedItemRanking(table, chunk_rows=3000, block_bytes=2**40)
    assert torch.equal(ranks, whole.target_ranks(**inputs))
    expected_scores, expected_ids = whole.top_k(inputs["queries"], 7, *seen)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(scores, expected_scores)  # a matrix product's last bit depends on its shape


@pytest.mark.parametrize("num_items", [20_000, 60_000])
def test_a_call_allocates_about_one_score_block_whatever_the_table_size(num_items: int) -> None:
    # 500 rows per chunk for 64 queries: 40 and 120 chunks. A boolean block reduced along a dimension (torch
    # converts it to int64 first: 8 bytes an entry, twice the float block) or a second float block would exceed
    # these bounds at once; so would a temporary that outlived its chunk, on the larger table.
    batch, k = 64, 10
    table, inputs = torch.randn(num_items, DIM, generator=torch.Generator().manual_seed(2)), _inputs(num_items, batch, 3)
    block_bytes = batch * 500 * 4
    ranking = UnshardedItemRanking(table, block_bytes=block_bytes)
    seen = (inputs["seen_ids"], inputs["seen_lengths"])
    ranks_peak = _peak_allocated_bytes(lambda: ranking.target_ranks(**inputs))
    top_k_peak = _peak_allocated_bytes(lambda: ranking.top_k(inputs["queries"], k, *seen))
    mask = block_bytes // 4  # the block's boolean mask
    candidates = 8 * batch * (2 * k) * (4 + 8)  # a few copies of the [queries, 2k] scores and ids being merged
    assert block_bytes <= ranks_peak <= block_bytes + mask, ranks_peak
    assert block_bytes <= top_k_peak <= block_bytes + mask + candidates, top_k_peak


def _sorted_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(scores.shape[1]).expand(scores.shape[0], -1)
    return merge_top_k(scores, ids, k)


@pytest.mark.parametrize("kind", ["random", "ties", "one_value"])
@pytest.mark.parametrize(("k", "chunk"), [(1, 7), (5, 3), (5, 40), (30, 11)])
def test_the_running_top_k_equals_a_full_sort(kind: str, k: int, chunk: int) -> None:
    generator = torch.Generator().manual_seed(k * 100 + chunk)
    num_items, batch = 120, 9
    if kind == "random":
        table, queries = torch.randn(num_items, DIM, generator=generator), torch.randn(batch, DIM, generator=generator)
    else:  # few distinct small-integer rows: exact scores, many equal to each query's k-th
        table = torch.randint(-1, 2, (4, DIM), generator=generator).float()[torch.randint(0, 4, (num_items,), generator=generator)]
        queries = torch.randint(-2, 3, (batch, DIM), generator=generator).float()
        if kind == "one_value":
            queries[0] = 0  # every item scores 0: k among 120 equal scores
    lengths = torch.randint(0, 8, (batch,), generator=generator)
    lengths[-1] = num_items - 2 * k // 3 if num_items - 2 * k // 3 > 0 else 0  # a user who saw nearly all: -inf fills
    seen_ids = torch.cat([torch.randint(0, num_items, (int(lengths[:-1].sum()),), generator=generator), torch.arange(int(lengths[-1]))])
    seen = SeenItems.from_jagged(seen_ids, lengths)
    best = RunningTopK(batch, k, torch.float32, torch.device("cpu"))
    for start in range(0, num_items, chunk):
        best.add(queries, table[start : start + chunk], start, seen)
    scores, ids = best.result()
    every = queries @ table.T
    every[seen.mask(0, num_items)] = -torch.inf
    expected_scores, expected_ids = _sorted_top_k(every, k)
    assert torch.equal(ids, expected_ids), (ids, expected_ids)
    torch.testing.assert_close(scores, expected_scores)


def test_bad_block_bytes_are_named() -> None:
    with pytest.raises(ValueError, match="block_bytes=0 must be an integer >= 1"):
        UnshardedItemRanking(torch.zeros(3, DIM), block_bytes=0)

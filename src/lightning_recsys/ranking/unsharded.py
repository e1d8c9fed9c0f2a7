"""Brute-force full ranking over an item table held whole in this process: the reference for the sharded one.

Single-device code, below ``models/`` and ``parallel/``: a model ranks its own table with it, and
``parallel.ranking`` checks its sharded ranking against it.

The protocol (what every ``ItemRanking`` computes):

- A user's score for item ``j`` is ``query · table[j]`` (``table[j] / ||table[j]||`` with
  ``normalize_rows``, for a model that L2-normalises its item embeddings). The target's score is computed the same way
  (``(query * table[target]).sum()``), and every other row's by a matrix product over row chunks.
- ``target_ranks``: how many items score **at least** as high as the target, counting neither the
  target itself nor the items the user has seen (``seen_ids``; a seen target is still ranked). Ties
  count against the target (pessimistic), so a model that scores everything alike ranks last, never
  first. Rank 0 is the top.
- ``top_k``: the ``k`` highest-scoring items that the user has not seen, best first; equal scores are
  ordered by the lower id. With fewer than ``k`` items in the table, ``min(k, num_items)`` columns; seen
  items only fill the list (score ``-inf``) when fewer than ``k`` items are unseen.

The chunk functions (``ranking.chunks``: ``target_scores``, ``count_at_least``, ``RunningTopK``) are the one
arithmetic of a score; the sharded ranking calls them on the full rows each rank scores, so both count and
break ties alike. A matrix product's last bit depends on its shape (BLAS blocking), so scores can differ by one
rounding between chunk sizes or layouts (here too, between two ``chunk_rows``); a count can only differ where
an item scores within that rounding of the target.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lightning_recsys.contracts.ranking import ItemRanking
from lightning_recsys.ranking.chunks import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CHUNK_ROWS,
    RunningTopK,
    ScoreBlock,
    SeenItems,
    check_chunking,
    chunk_candidates,
    count_at_least,
    merge_top_k,
    rows_per_chunk,
    scored_rows,
    target_scores,
)

__all__ = [
    "DEFAULT_BLOCK_BYTES", "DEFAULT_CHUNK_ROWS", "ItemRanking", "SeenItems", "UnshardedItemRanking", "chunk_candidates",
    "merge_top_k", "ranking_input_problem", "seen_mask",
]


def seen_mask(
    seen_ids: torch.Tensor, seen_lengths: torch.Tensor, row_start: int, num_rows: int, batch_size: int
) -> torch.Tensor:
    """``[B, num_rows]`` bool: which rows ``row_start .. row_start + num_rows - 1`` each user has seen."""
    if seen_lengths.shape[0] != batch_size:
        raise ValueError(f"seen_lengths has {seen_lengths.shape[0]} entries; batch_size={batch_size} must match it.")
    return SeenItems.from_jagged(seen_ids, seen_lengths).mask(row_start, num_rows)


def ranking_input_problem(
    queries: torch.Tensor,
    seen_ids: torch.Tensor,
    seen_lengths: torch.Tensor,
    *,
    num_items: int,
    dim: int,
    target_ids: torch.Tensor | None = None,
) -> str | None:
    """What is wrong with one rank's ranking inputs for a ``[num_items, dim]`` table, or None."""
    if queries.dim() != 2 or queries.shape[1] != dim:
        return f"queries must be [batch, {dim}] (the table's dim), got shape {tuple(queries.shape)}."
    batch = queries.shape[0]
    if seen_lengths.shape != (batch,):
        return f"seen_lengths must be [{batch}] (one per query), got shape {tuple(seen_lengths.shape)}."
    if seen_ids.dim() != 1 or seen_ids.numel() != int(seen_lengths.sum()) or bool((seen_lengths < 0).any()):
        return (
            f"seen_ids ({seen_ids.numel()} ids, shape {tuple(seen_ids.shape)}) must be 1-D with sum(seen_lengths) = "
            f"{int(seen_lengths.sum())} ids, and seen_lengths must be >= 0."
        )
    ids = [("seen_ids", seen_ids)] + ([("target_ids", target_ids)] if target_ids is not None else [])
    if target_ids is not None and target_ids.shape != (batch,):
        return f"target_ids must be [{batch}] (one per query), got shape {tuple(target_ids.shape)}."
    for name, values in ids:
        outside = values[(values < 0) | (values >= num_items)]
        if outside.numel():
            return f"{name} contains {outside[:5].tolist()}, outside the table's rows 0..{num_items - 1}."
    return None


def check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be an integer >= 1.")


class UnshardedItemRanking:
    """``ItemRanking`` over a whole table ``[num_items, D]`` in this process, chunk by chunk.

    A chunk has at most ``chunk_rows`` rows and at most ``block_bytes`` of scores (``rows_per_chunk``).
    Memory: that block and a boolean mask of its shape (reused by every chunk), plus one chunk's rows
    (normalised one chunk at a time with ``normalize_rows``).
    The table is read when this is built: build it again after the table changes (training).
    """

    def __init__(
        self,
        table: torch.Tensor,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        normalize_rows: bool = False,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> None:
        if table.dim() != 2:
            raise ValueError(f"table must be [num_items, dim], got shape {tuple(table.shape)}.")
        check_chunking(chunk_rows, block_bytes)
        self.table = table
        self.chunk_rows = chunk_rows
        self.block_bytes = block_bytes
        self.normalize_rows = normalize_rows

    def _check(
        self, queries: torch.Tensor, seen_ids: torch.Tensor, seen_lengths: torch.Tensor, target_ids: torch.Tensor | None = None
    ) -> None:
        problem = ranking_input_problem(
            queries, seen_ids, seen_lengths, num_items=self.table.shape[0], dim=self.table.shape[1], target_ids=target_ids
        )
        if problem is not None:
            raise ValueError(problem)

    def _chunks(self, num_queries: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first row id, rows as scored)`` of every chunk."""
        step = rows_per_chunk(num_queries, self.table.element_size(), self.chunk_rows, self.block_bytes)
        for start in range(0, self.table.shape[0], step):
            yield start, scored_rows(self.table[start : start + step], self.normalize_rows)

    @torch.no_grad()
    def target_ranks(
        self, queries: torch.Tensor, target_ids: torch.Tensor, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> torch.Tensor:
        self._check(queries, seen_ids, seen_lengths, target_ids)
        queries = queries.to(self.table.dtype)
        scores_of_targets = target_scores(queries, scored_rows(self.table[target_ids], self.normalize_rows))
        seen = SeenItems.from_jagged(seen_ids, seen_lengths)
        ranks = torch.zeros(queries.shape[0], dtype=torch.long, device=queries.device)
        block = ScoreBlock()
        for start, rows in self._chunks(queries.shape[0]):
            ranks += count_at_least(block, queries, rows, start, scores_of_targets, target_ids, seen)
        return ranks

    @torch.no_grad()
    def top_k(
        self, queries: torch.Tensor, k: int, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_k(k)
        self._check(queries, seen_ids, seen_lengths)
        queries = queries.to(self.table.dtype)
        seen = SeenItems.from_jagged(seen_ids, seen_lengths)
        best = RunningTopK(queries.shape[0], k, self.table.dtype, queries.device)
        for start, rows in self._chunks(queries.shape[0]):
            best.add(queries, rows, start, seen)
        return best.result()

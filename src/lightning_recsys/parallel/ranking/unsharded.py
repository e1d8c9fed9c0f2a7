"""Brute-force full ranking over an item table held whole in this process: the reference for the sharded one.

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

The chunk functions below (``target_scores``, ``count_at_least``, ``chunk_candidates``) are the one
arithmetic of a score; the sharded ranking calls them on the full rows each rank scores, so both count and
break ties alike. A matrix product's last bit depends on its shape (BLAS blocking), so scores can differ by one
rounding between chunk sizes or layouts (here too, between two ``chunk_rows``); a count can only differ where
an item scores within that rounding of the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

DEFAULT_CHUNK_ROWS = 65_536


class ItemRanking(Protocol):
    """Exact full ranking of an item table for query vectors ``[B, D]`` (see this module's protocol)."""

    def target_ranks(
        self, queries: torch.Tensor, target_ids: torch.Tensor, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> torch.Tensor:
        """``[B]`` int64: how many unseen items other than the target score at least the target's score."""
        ...

    def top_k(
        self, queries: torch.Tensor, k: int, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores, ids)``, each ``[B, min(k, num_items)]``: the best unseen items, best first (ties: lower id first)."""
        ...


@dataclass(frozen=True)
class SeenItems:
    """The items each query has seen, as ``(query index, row id)`` pairs: made once per call, masked per chunk."""

    users: torch.Tensor
    ids: torch.Tensor
    batch_size: int

    @classmethod
    def from_jagged(cls, seen_ids: torch.Tensor, seen_lengths: torch.Tensor) -> SeenItems:
        # The query of seen entry i: the first whose cumulative length exceeds i (torch.repeat_interleave with
        # tensor repeats, the obvious way, measured ~100x slower on this project's CPU machine).
        ends = seen_lengths.to(seen_ids.device).cumsum(0)
        users = torch.searchsorted(ends, torch.arange(seen_ids.numel(), device=seen_ids.device), right=True)
        return cls(users, seen_ids, seen_lengths.shape[0])

    def positions(self, row_start: int, num_rows: int) -> torch.Tensor:
        """Flat positions in a ``[B, num_rows]`` block of rows ``row_start ..`` that the query has seen (repeats kept)."""
        local = self.ids - row_start
        inside = (local >= 0) & (local < num_rows)
        return self.users[inside] * num_rows + local[inside]

    def mask(self, row_start: int, num_rows: int) -> torch.Tensor:
        """``[B, num_rows]`` bool: which rows ``row_start .. row_start + num_rows - 1`` each query has seen."""
        mask = torch.zeros(self.batch_size * num_rows, dtype=torch.bool, device=self.ids.device)
        mask[self.positions(row_start, num_rows)] = True
        return mask.view(self.batch_size, num_rows)


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


def check_chunk_rows(chunk_rows: int) -> None:
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r} must be an integer >= 1.")


def scored_rows(rows: torch.Tensor, normalize_rows: bool) -> torch.Tensor:
    """The rows as they are scored: L2-normalised with ``normalize_rows`` (each row on its own: full rows only)."""
    return torch.nn.functional.normalize(rows, dim=-1) if normalize_rows else rows


def target_scores(queries: torch.Tensor, target_rows: torch.Tensor) -> torch.Tensor:
    """``[B]``: each query's score for its target row (already as scored)."""
    return (queries * target_rows).sum(-1)


def count_at_least(
    queries: torch.Tensor,
    rows: torch.Tensor,
    row_start: int,
    scores_of_targets: torch.Tensor,
    target_ids: torch.Tensor,
    seen: SeenItems,
) -> torch.Tensor:
    """``[B]``: how many of ``rows`` (ids from ``row_start``) are unseen, not the target, and score >= the target."""
    num_rows = rows.shape[0]
    above = queries @ rows.T >= scores_of_targets[:, None]
    # Count every row, then take off the seen ones and the target where they were counted, each pair once:
    # the same count as masking the block, without three more [B, rows] tensors.
    local_targets = target_ids - row_start
    inside = (local_targets >= 0) & (local_targets < num_rows)
    targets = torch.arange(queries.shape[0], device=queries.device)[inside] * num_rows + local_targets[inside]
    excluded = torch.unique(torch.cat([seen.positions(row_start, num_rows), targets]))
    counts = above.sum(1)
    counts.index_add_(0, excluded // num_rows, -above.view(-1)[excluded].long())
    return counts


def chunk_candidates(
    queries: torch.Tensor, rows: torch.Tensor, row_start: int, seen: SeenItems, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, ids)`` ``[B, min(k, rows)]``: the chunk's best ``k`` rows per query (seen ones score ``-inf``),
    by score then lower id, in id order."""
    scores = queries @ rows.T
    scores.view(-1)[seen.positions(row_start, rows.shape[0])] = -torch.inf
    ids = torch.arange(row_start, row_start + rows.shape[0], device=queries.device).expand(queries.shape[0], -1)
    if rows.shape[0] <= k:
        return scores, ids
    # torch.topk's choice among equal scores is unspecified, so it only finds each query's k-th score; then the
    # rows above it and, of those equal to it, the lowest ids: exactly k per query, as a full sort would give.
    kth = torch.topk(scores, k, dim=1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(1, keepdim=True)
    keep = above | tied
    surplus = (tied.sum(1, keepdim=True) > room).squeeze(1).nonzero().squeeze(1)  # queries with more ties than room
    if surplus.numel():
        keep[surplus] = above[surplus] | (tied[surplus] & (tied[surplus].cumsum(1) <= room[surplus]))
    return scores[keep].view(-1, k), ids[keep].view(-1, k)


def no_candidates(batch: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty ``(scores, ids)`` list per query, to merge chunks into."""
    return torch.full((batch, 0), -torch.inf, dtype=dtype, device=device), torch.zeros((batch, 0), dtype=torch.long, device=device)


def merge_top_k(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``k`` of candidate ``(scores, ids)`` per row: higher score first, then lower id."""
    by_id = torch.argsort(ids, dim=1, stable=True)
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    order = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]
    return scores.gather(1, order), ids.gather(1, order)


class UnshardedItemRanking:
    """``ItemRanking`` over a whole table ``[num_items, D]`` in this process, ``chunk_rows`` rows at a time.

    Memory: the ``[B, chunk_rows]`` scores of one chunk (and the normalised table with ``normalize_rows``).
    The table is read when this is built: build it again after the table changes (training).
    """

    def __init__(self, table: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS, normalize_rows: bool = False) -> None:
        if table.dim() != 2:
            raise ValueError(f"table must be [num_items, dim], got shape {tuple(table.shape)}.")
        check_chunk_rows(chunk_rows)
        self.table = scored_rows(table, normalize_rows)
        self.chunk_rows = chunk_rows

    def _check(
        self, queries: torch.Tensor, seen_ids: torch.Tensor, seen_lengths: torch.Tensor, target_ids: torch.Tensor | None = None
    ) -> None:
        problem = ranking_input_problem(
            queries, seen_ids, seen_lengths, num_items=self.table.shape[0], dim=self.table.shape[1], target_ids=target_ids
        )
        if problem is not None:
            raise ValueError(problem)

    @torch.no_grad()
    def target_ranks(
        self, queries: torch.Tensor, target_ids: torch.Tensor, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> torch.Tensor:
        self._check(queries, seen_ids, seen_lengths, target_ids)
        queries = queries.to(self.table.dtype)
        scores_of_targets = target_scores(queries, self.table[target_ids])
        seen = SeenItems.from_jagged(seen_ids, seen_lengths)
        ranks = torch.zeros(queries.shape[0], dtype=torch.long, device=queries.device)
        for start in range(0, self.table.shape[0], self.chunk_rows):
            rows = self.table[start : start + self.chunk_rows]
            ranks += count_at_least(queries, rows, start, scores_of_targets, target_ids, seen)
        return ranks

    @torch.no_grad()
    def top_k(
        self, queries: torch.Tensor, k: int, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_k(k)
        self._check(queries, seen_ids, seen_lengths)
        queries = queries.to(self.table.dtype)
        seen = SeenItems.from_jagged(seen_ids, seen_lengths)
        best_scores, best_ids = no_candidates(queries.shape[0], self.table.dtype, queries.device)
        for start in range(0, self.table.shape[0], self.chunk_rows):
            scores, ids = chunk_candidates(queries, self.table[start : start + self.chunk_rows], start, seen, k)
            best_scores, best_ids = merge_top_k(torch.cat([best_scores, scores], 1), torch.cat([best_ids, ids], 1), k)
        return best_scores, best_ids

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
  ordered by the lower id.
"""

from __future__ import annotations

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
        """``(scores, ids)``, each ``[B, k]``: the best ``k`` unseen items, best first (ties: lower id first)."""
        ...


def seen_mask(
    seen_ids: torch.Tensor, seen_lengths: torch.Tensor, row_start: int, num_rows: int, batch_size: int
) -> torch.Tensor:
    """``[B, num_rows]`` bool: which rows ``row_start .. row_start + num_rows - 1`` each user has seen."""
    mask = torch.zeros(batch_size, num_rows, dtype=torch.bool, device=seen_ids.device)
    users = torch.repeat_interleave(torch.arange(batch_size, device=seen_ids.device), seen_lengths)
    local = seen_ids - row_start
    inside = (local >= 0) & (local < num_rows)
    mask[users[inside], local[inside]] = True
    return mask


class UnshardedItemRanking:
    """``ItemRanking`` over a whole table ``[num_items, D]`` in this process, ``chunk_rows`` rows at a time."""

    def __init__(self, table: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS, normalize_rows: bool = False) -> None:
        if table.dim() != 2:
            raise ValueError(f"table must be [num_items, dim], got shape {tuple(table.shape)}.")
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows={chunk_rows} must be >= 1.")
        self.table = torch.nn.functional.normalize(table, dim=-1) if normalize_rows else table
        self.chunk_rows = chunk_rows

    @torch.no_grad()
    def target_ranks(
        self, queries: torch.Tensor, target_ids: torch.Tensor, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> torch.Tensor:
        queries = queries.to(self.table.dtype)
        batch = queries.shape[0]
        target_scores = (queries * self.table[target_ids]).sum(-1)
        ranks = torch.zeros(batch, dtype=torch.long, device=queries.device)
        for start in range(0, self.table.shape[0], self.chunk_rows):
            rows = self.table[start : start + self.chunk_rows]
            above = queries @ rows.T >= target_scores[:, None]
            above &= ~seen_mask(seen_ids, seen_lengths, start, rows.shape[0], batch)
            ids = torch.arange(start, start + rows.shape[0], device=queries.device)
            above &= ids[None, :] != target_ids[:, None]
            ranks += above.sum(1)
        return ranks

    @torch.no_grad()
    def top_k(
        self, queries: torch.Tensor, k: int, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        queries = queries.to(self.table.dtype)
        batch = queries.shape[0]
        best_scores = torch.full((batch, 0), -torch.inf, dtype=self.table.dtype, device=queries.device)
        best_ids = torch.zeros((batch, 0), dtype=torch.long, device=queries.device)
        for start in range(0, self.table.shape[0], self.chunk_rows):
            rows = self.table[start : start + self.chunk_rows]
            scores = (queries @ rows.T).masked_fill(seen_mask(seen_ids, seen_lengths, start, rows.shape[0], batch), -torch.inf)
            ids = torch.arange(start, start + rows.shape[0], device=queries.device).expand(batch, -1)
            best_scores, best_ids = merge_top_k(torch.cat([best_scores, scores], 1), torch.cat([best_ids, ids], 1), k)
        return best_scores, best_ids


def merge_top_k(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``k`` of candidate ``(scores, ids)`` per row: higher score first, then lower id."""
    by_id = torch.argsort(ids, dim=1, stable=True)
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    order = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]
    return scores.gather(1, order), ids.gather(1, order)

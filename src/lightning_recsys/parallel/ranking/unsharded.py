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

The chunk functions below (``target_scores``, ``count_at_least``, ``RunningTopK``) are the one
arithmetic of a score; the sharded ranking calls them on the full rows each rank scores, so both count and
break ties alike.

Memory: a chunk's scores are a ``[queries, rows]`` block, so a chunk has at most ``chunk_rows`` rows and at most
``block_bytes`` of scores (``rows_per_chunk``): the bound holds for any number of queries, and the rest of a
chunk's work (a boolean of the same shape, the rows themselves) is a fraction of it. A matrix product's last bit depends on its shape (BLAS blocking), so scores can differ by one
rounding between chunk sizes or layouts (here too, between two ``chunk_rows``); a count can only differ where
an item scores within that rounding of the target.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

DEFAULT_CHUNK_ROWS = 65_536
# 16 MiB of float32 scores: 4,096 rows for 1,000 queries, 16,384 for 256. Measured on this project's CPU machine
# (1,000 queries, dim 64): 4,096-row chunks counted ~2x faster than 65,536-row ones, whose 250 MiB blocks
# are fresh pages at every chunk.
DEFAULT_BLOCK_BYTES = 16 * 2**20


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


def check_chunking(chunk_rows: int, block_bytes: int) -> None:
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r} must be an integer >= 1.")
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes={block_bytes!r} must be an integer >= 1 (bytes of one chunk's score block).")


def rows_per_chunk(num_queries: int, element_size: int, chunk_rows: int, block_bytes: int) -> int:
    """Rows of one chunk: at most ``chunk_rows``, and at most ``block_bytes`` of ``[num_queries, rows]`` scores
    (at least one row: a single row's scores for more than ``block_bytes`` of queries exceed it)."""
    return max(1, min(chunk_rows, block_bytes // (max(1, num_queries) * element_size)))


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
    counts = above.sum(1, dtype=torch.int32).long()  # an int32 sum of a bool block: ~3x faster than int64, exact
    counts.index_add_(0, excluded // num_rows, -above.view(-1)[excluded].long())
    return counts


def chunk_candidates(
    queries: torch.Tensor, rows: torch.Tensor, row_start: int, seen: SeenItems, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, ids)`` ``[B, min(k, rows)]``: the chunk's best ``k`` rows per query (seen ones score ``-inf``),
    by score then lower id, in id order."""
    return _best_of_block(_chunk_scores(queries, rows, row_start, seen), row_start, k)


def _chunk_scores(queries: torch.Tensor, rows: torch.Tensor, row_start: int, seen: SeenItems) -> torch.Tensor:
    scores = queries @ rows.T
    scores.view(-1)[seen.positions(row_start, rows.shape[0])] = -torch.inf
    return scores


def _best_of_block(scores: torch.Tensor, row_start: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``k`` columns of each row of a ``[B, rows]`` score block (ids from ``row_start``), in id order."""
    num_rows = scores.shape[1]
    ids = torch.arange(row_start, row_start + num_rows, device=scores.device).expand(scores.shape[0], -1)
    if num_rows <= k:
        return scores, ids
    # torch.topk's choice among equal scores is unspecified, so it only finds each query's k-th score; then the
    # rows above it and, of those equal to it, the lowest ids: exactly k per query, as a full sort would give.
    kth = torch.topk(scores, k, dim=1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(1, keepdim=True, dtype=torch.int32)
    keep = above | tied
    surplus = (tied.sum(1, keepdim=True, dtype=torch.int32) > room).squeeze(1).nonzero().squeeze(1)  # more ties than room
    if surplus.numel():
        keep[surplus] = above[surplus] | (tied[surplus] & (tied[surplus].cumsum(1, dtype=torch.int32) <= room[surplus]))
    return scores[keep].view(-1, k), ids[keep].view(-1, k)


class RunningTopK:
    """The best ``k`` ``(score, id)`` of each of ``batch`` queries over the chunks added so far (``merge_top_k``'s order).

    Once a query holds ``k`` candidates, its ``k``-th score is a threshold: a row scoring below it can never
    enter, so a chunk keeps only the rows at or above it (ties kept: a lower id may still win). That is a
    comparison where ``torch.topk`` over the block was ~5x slower (1,000 queries, k = 100, 4,096 rows,
    measured on this project's CPU machine); a chunk where more than ``k`` rows pass for a query (the first chunks, or many
    ties) takes the ``torch.topk`` path. Candidates wait until ``k`` columns of them are pending, then merge.
    """

    def __init__(self, batch: int, k: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = k
        self.scores, self.ids = no_candidates(batch, dtype, device)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_width = 0

    def add(self, queries: torch.Tensor, rows: torch.Tensor, row_start: int, seen: SeenItems) -> None:
        """Score ``rows`` (ids ``row_start ..``, as scored) against ``queries`` and keep their candidates."""
        scores = _chunk_scores(queries, rows, row_start, seen)
        batch = scores.shape[0]
        if self.scores.shape[1] < self.k:  # some query holds fewer than k: no threshold yet
            self._push(*_best_of_block(scores, row_start, self.k))
            self._merge()
            return
        passing = scores >= self.scores[:, -1:]
        counts = passing.sum(1, dtype=torch.int32)
        width = int(counts.max()) if batch else 0
        if width > self.k:  # a query with more than a top-k's worth (the first chunks, many ties): take the top-k
            del passing
            self._push(*_best_of_block(scores, row_start, self.k))
        elif width:
            users, columns = passing.nonzero(as_tuple=True)  # query-major: each query's candidates together
            slots = torch.arange(users.numel(), device=scores.device) - (counts.cumsum(0) - counts).long()[users]
            candidate_scores = scores.new_full((batch, width), -torch.inf)
            candidate_scores[users, slots] = scores[users, columns]
            # Padding: -inf with an id past every table, so it sorts after every real candidate and never enters.
            candidate_ids = torch.full((batch, width), torch.iinfo(torch.long).max, dtype=torch.long, device=scores.device)
            candidate_ids[users, slots] = columns + row_start
            self._push(candidate_scores, candidate_ids)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores, ids)`` ``[batch, min(k, rows added)]``, best first."""
        self._merge()
        return self.scores, self.ids

    def _push(self, scores: torch.Tensor, ids: torch.Tensor) -> None:
        self._pending.append((scores, ids))
        self._pending_width += scores.shape[1]
        if self._pending_width >= self.k:
            self._merge()

    def _merge(self) -> None:
        if not self._pending:
            return
        scores = torch.cat([self.scores, *(s for s, _ in self._pending)], 1)
        ids = torch.cat([self.ids, *(i for _, i in self._pending)], 1)
        self.scores, self.ids = merge_top_k(scores, ids, self.k)
        self._pending, self._pending_width = [], 0


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
    """``ItemRanking`` over a whole table ``[num_items, D]`` in this process, chunk by chunk.

    A chunk has at most ``chunk_rows`` rows and at most ``block_bytes`` of scores (``rows_per_chunk``).
    Memory: about twice that block, plus one chunk's rows (normalised one chunk at a time with ``normalize_rows``).
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
        for start, rows in self._chunks(queries.shape[0]):
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
        best = RunningTopK(queries.shape[0], k, self.table.dtype, queries.device)
        for start, rows in self._chunks(queries.shape[0]):
            best.add(queries, rows, start, seen)
        return best.result()

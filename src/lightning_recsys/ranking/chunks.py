"""The arithmetic of one chunk of rows, shared by the brute force and the sharded ranking: so both count and
break ties alike.

A chunk's scores are a ``[queries, rows]`` block. A chunk has at most ``chunk_rows`` rows and at most
``block_bytes`` of scores (``rows_per_chunk``), so the bound holds for any number of queries. ``ScoreBlock``
allocates that block and a boolean mask of its shape once per call, and every chunk writes into them:
allocated per chunk, they left the process's resident memory several blocks above the live tensors (glibc's
malloc raises its mmap threshold after a large free, and its heap then fragments) and cost fresh pages at
every chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CHUNK_ROWS = 65_536
# 16 MiB of float32 scores: 4,194 rows for 1,000 queries, 16,384 for 256. Measured on this project's CPU machine
# (1,000 queries, dim 64, one thread): 4,096-row chunks counted ~2x faster than 65,536-row ones.
DEFAULT_BLOCK_BYTES = 16 * 2**20


def check_chunking(chunk_rows: int, block_bytes: int) -> None:
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows!r} must be an integer >= 1.")
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes={block_bytes!r} must be an integer >= 1 (bytes of one chunk's score block).")


MAX_CHUNK_ROWS = 2**24  # a float32 sum of 0/1 values is exact up to 2**24 (ScoreBlock.row_sums)


def rows_per_chunk(num_queries: int, element_size: int, chunk_rows: int, block_bytes: int) -> int:
    """Rows of one chunk: at most ``chunk_rows`` (and ``MAX_CHUNK_ROWS``), and at most ``block_bytes`` of
    ``[num_queries, rows]`` scores (at least one row: one row's scores for more than ``block_bytes`` of queries exceed it)."""
    return max(1, min(chunk_rows, MAX_CHUNK_ROWS, block_bytes // (max(1, num_queries) * element_size)))


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


class ScoreBlock:
    """One chunk's ``[queries, rows]`` scores and a boolean mask of that shape, allocated at the first (and
    largest) chunk of a call and reused by the next ones: the same memory for every chunk.

    Reductions here never reduce a boolean block along a dimension: torch converts it to the accumulator's
    dtype first (a ``[queries, rows]`` int64 copy, 8x the mask; measured with torch.profiler). Counts come
    from ``torch.count_nonzero`` over a whole block, or from a 0/1 float block times a vector of ones.
    """

    def __init__(self) -> None:
        self._scores: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._ones: torch.Tensor | None = None

    def scores(self, queries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``queries @ rows.T`` ``[B, rows]``, written into the block."""
        size = queries.shape[0] * rows.shape[0]
        if self._scores is None or self._scores.numel() < size or self._scores.dtype != queries.dtype:
            self._scores = None  # free the smaller one first
            self._scores = torch.empty(size, dtype=queries.dtype, device=queries.device)
        return torch.mm(queries, rows.T, out=self._scores[:size].view(queries.shape[0], rows.shape[0]))

    def mask(self, like: torch.Tensor) -> torch.Tensor:
        """The boolean mask, shaped as the score block ``like`` (values left as they were)."""
        if self._mask is None or self._mask.numel() < like.numel():
            self._mask = None
            self._mask = torch.empty(like.numel(), dtype=torch.bool, device=like.device)
        return self._mask[: like.numel()].view(like.shape)

    def row_sums(self, block: torch.Tensor) -> torch.Tensor:
        """``[B]``: each row's sum of a 0/1 float block, as a matrix-vector product; exact: float32 or wider counts
        to 2**24, which ``rows_per_chunk`` keeps a chunk under (a half-precision block is widened first)."""
        if torch.finfo(block.dtype).bits < 32:
            block = block.float()
        if self._ones is None or self._ones.numel() < block.shape[1] or self._ones.dtype != block.dtype:
            self._ones = torch.ones(block.shape[1], dtype=block.dtype, device=block.device)
        return torch.mv(block, self._ones[: block.shape[1]])


def scored_rows(rows: torch.Tensor, normalize_rows: bool) -> torch.Tensor:
    """The rows as they are scored: L2-normalised with ``normalize_rows`` (each row on its own: full rows only)."""
    return torch.nn.functional.normalize(rows, dim=-1) if normalize_rows else rows


def target_scores(queries: torch.Tensor, target_rows: torch.Tensor) -> torch.Tensor:
    """``[B]``: each query's score for its target row (already as scored)."""
    return (queries * target_rows).sum(-1)


def count_at_least(
    block: ScoreBlock,
    queries: torch.Tensor,
    rows: torch.Tensor,
    row_start: int,
    scores_of_targets: torch.Tensor,
    target_ids: torch.Tensor,
    seen: SeenItems,
) -> torch.Tensor:
    """``[B]``: how many of ``rows`` (ids from ``row_start``) are unseen, not the target, and score >= the target."""
    num_rows = rows.shape[0]
    above = block.scores(queries, rows).ge_(scores_of_targets[:, None])  # 1.0 / 0.0 in place of the scores
    # Count every row, then take off the seen ones and the target where they were counted, each pair once:
    # the same count as masking the block, without three more [B, rows] tensors.
    local_targets = target_ids - row_start
    inside = (local_targets >= 0) & (local_targets < num_rows)
    targets = torch.arange(queries.shape[0], device=queries.device)[inside] * num_rows + local_targets[inside]
    excluded = torch.unique(torch.cat([seen.positions(row_start, num_rows), targets]))
    counts = block.row_sums(above).long()
    counts.index_add_(0, excluded // num_rows, -above.view(-1)[excluded].long())
    return counts


def chunk_scores(block: ScoreBlock, queries: torch.Tensor, rows: torch.Tensor, row_start: int, seen: SeenItems) -> torch.Tensor:
    """The chunk's ``[B, rows]`` scores in ``block``, the rows each query has seen at ``-inf``."""
    scores = block.scores(queries, rows)
    scores.view(-1)[seen.positions(row_start, rows.shape[0])] = -torch.inf
    return scores


def chunk_candidates(
    queries: torch.Tensor, rows: torch.Tensor, row_start: int, seen: SeenItems, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, ids)`` ``[B, min(k, rows)]``: the chunk's best ``k`` rows per query (seen ones score ``-inf``),
    by score then lower id; not in order."""
    block = ScoreBlock()
    return best_of_block(block, chunk_scores(block, queries, rows, row_start, seen), row_start, k)


def best_of_block(block: ScoreBlock, scores: torch.Tensor, row_start: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``k`` columns of each row of the ``[B, rows]`` scores in ``block`` (ids from ``row_start``): by
    score, then lower id; not in order."""
    batch, num_rows = scores.shape
    if num_rows <= k:
        return scores.clone(), torch.arange(row_start, row_start + num_rows, device=scores.device).expand(batch, -1)
    values, columns = torch.topk(scores, k, dim=1)
    # torch.topk's choice among scores equal to the k-th is unspecified: where a row has more of them than it
    # kept (more rows >= its k-th score than k), keep the lowest ids among them, as a full sort would.
    kth = values[:, -1:]
    at_least = torch.ge(scores, kth, out=block.mask(scores))
    if int(torch.count_nonzero(at_least)) > batch * k:
        group = max(1, batch // 16)  # rows resolved at a time: their [group, rows] temporaries stay ~1/4 of the block
        for first in range(0, batch, group):
            counts = at_least[first : first + group].sum(1)
            tied_rows = (counts > k).nonzero().squeeze(1) + first
            if tied_rows.numel():
                values[tied_rows], columns[tied_rows] = _lowest_ids_among_ties(scores[tied_rows], kth[tied_rows], k)
    return values, columns + row_start


def _lowest_ids_among_ties(scores: torch.Tensor, kth: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, columns)`` ``[R, k]``: each row's columns above ``kth`` and, of those equal to it, the first ones."""
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(1) <= room))
    columns = chosen.nonzero()[:, 1].view(-1, k)
    return scores.gather(1, columns), columns


class RunningTopK:
    """The best ``k`` ``(score, id)`` of each of ``batch`` queries over the chunks added so far (``merge_top_k``'s order).

    Once a query holds ``k`` candidates, its ``k``-th score is a threshold: a row scoring below it can never
    enter, so a chunk keeps only the rows at or above it (ties kept: a lower id may still win). That is one
    comparison where ``torch.topk`` over the block took ~5x as long (1,000 queries, k = 100, 4,096 rows, one
    thread, on this project's CPU machine). A chunk where more than ``k`` rows pass for some query (the first
    chunks, or many ties) takes the ``torch.topk`` path. Candidates wait until ``k`` columns of them are
    pending, then merge.
    """

    def __init__(self, batch: int, k: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = k
        self.block = ScoreBlock()
        self.scores, self.ids = no_candidates(batch, dtype, device)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_width = 0

    def add(self, queries: torch.Tensor, rows: torch.Tensor, row_start: int, seen: SeenItems) -> None:
        """Score ``rows`` (ids ``row_start ..``, as scored) against ``queries`` and keep their candidates."""
        scores = chunk_scores(self.block, queries, rows, row_start, seen)
        batch = scores.shape[0]
        if self.scores.shape[1] < self.k:  # some query holds fewer than k: no threshold yet
            self._push(*best_of_block(self.block, scores, row_start, self.k))
            self._merge()
            return
        passing = torch.ge(scores, self.scores[:, -1:], out=self.block.mask(scores))
        total = int(torch.count_nonzero(passing))
        if total == 0:
            return
        if total <= batch * self.k:
            users, columns = passing.nonzero(as_tuple=True)  # query-major: each query's candidates together
            counts = torch.bincount(users, minlength=batch)
            width = int(counts.max())
            if width <= self.k:
                slots = torch.arange(total, device=scores.device) - (counts.cumsum(0) - counts)[users]
                candidate_scores = scores.new_full((batch, width), -torch.inf)
                candidate_scores[users, slots] = scores[users, columns]
                # Padding: -inf with an id past every table, so it sorts after every real candidate and never enters.
                candidate_ids = torch.full((batch, width), torch.iinfo(torch.long).max, dtype=torch.long, device=scores.device)
                candidate_ids[users, slots] = columns + row_start
                self._push(candidate_scores, candidate_ids)
                return
        # Some query has more than a top-k's worth (the first chunks, or many ties): take the block's top-k.
        self._push(*best_of_block(self.block, scores, row_start, self.k))

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

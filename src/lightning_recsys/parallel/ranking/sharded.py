"""Exact full ranking over a TorchRec-sharded ``EmbeddingCollection`` table, inside its sharding group.

Every rank of the group calls ``target_ranks`` (or ``top_k``) with its own users, at the same point. Then:

1. The group all-gathers its queries, targets and seen ids (any batch sizes, 0 included).
2. Every rank scores the rows it holds against every query of the group, chunk by chunk (at most
   ``chunk_rows`` rows and ``block_bytes`` of scores for the group's ``Q`` queries: ``unsharded.rows_per_chunk``,
   the same on every rank), with the reference's arithmetic (``unsharded.count_at_least``,
   ``unsharded.RunningTopK``). Rows cut into column slices (column-wise, table-wise-column-wise) are put
   together first: each chunk of ``rows x group size`` rows is split among the ranks, and one all-to-all sends
   each rank the other ranks' columns of its part, so it scores full rows, never partial dot products.
3. Target scores: the target rows' pieces are summed into full rows on every rank (one holder per value,
   so exact), and scored as the reference does (``(query * row).sum()``).
4. Ranks: each rank counts, for every query, its unseen non-target rows scoring >= the target; the counts
   are summed over the group. Top-K: each rank's top-K of every query goes to the query's owner, which
   merges them (``merge_top_k``: higher score, then lower id).

No rank gathers the table. Memory per rank: one chunk's score block (at most ``block_bytes``) and a boolean
mask of its shape, reused by every chunk, plus the chunk's rows, plus ``[Q, 2k]`` candidates.
A table this rank holds whole (data-parallel, or not sharded) is ranked locally, with no collective.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.types import ShardedModule

from lightning_recsys.parallel.ranking.exchange import (
    GroupQueries,
    gather_group_queries,
    share_target_rows,
    sum_to_owners,
    top_k_to_owners,
)
from lightning_recsys.parallel.ranking.table_shards import ColumnSlicedRows, ShardedTableLayout, read_table
from lightning_recsys.ranking.chunks import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CHUNK_ROWS,
    RunningTopK,
    ScoreBlock,
    SeenItems,
    check_chunking,
    count_at_least,
    merge_top_k,
    rows_per_chunk,
    scored_rows,
    target_scores,
)
from lightning_recsys.ranking.unsharded import ItemRanking, UnshardedItemRanking, check_k


class ShardedItemRanking:
    """``ItemRanking`` over table ``table_name`` of a (sharded) ``EmbeddingCollection``, over its sharding group.

    ``module``: the ``ShardedEmbeddingCollection`` that ``DistributedModelParallel`` put in place of the
    model's ``EmbeddingCollection``. ``process_group``: the group the table is sharded over (1D: the world;
    2D: this rank's sharding group, ``ParallelTopology.sharding_process_group()``; None only for a table every
    rank holds whole, which is ranked locally). Every rank of that group must make the same calls in the same
    order. The table is read once, when this is built (one ``state_dict()``: where this rank's shards are, and
    the shards themselves, not copies): build it again after the table is re-sharded or reloaded; build it once
    per evaluation loop, since the weights do not change during one.
    """

    def __init__(
        self,
        module: nn.Module,
        table_name: str,
        process_group: dist.ProcessGroup | None,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        normalize_rows: bool = False,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> None:
        check_chunking(chunk_rows, block_bytes)
        self.group = process_group
        self.chunk_rows = chunk_rows
        self.block_bytes = block_bytes
        self.normalize_rows = normalize_rows
        table = read_table(module, table_name, process_group)
        # A table held whole here (data-parallel, or not sharded) is ranked locally, with no exchange.
        self._whole = UnshardedItemRanking(table, chunk_rows, normalize_rows, block_bytes) if isinstance(table, torch.Tensor) else None
        self._layout = table if isinstance(table, ShardedTableLayout) else None

    @torch.no_grad()
    def target_ranks(
        self, queries: torch.Tensor, target_ids: torch.Tensor, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> torch.Tensor:
        if self._whole is not None:
            return self._whole.target_ranks(queries, target_ids, seen_ids, seen_lengths)
        table = self._sharded_layout()
        device = table.device or queries.device
        group = self._sharding_group()
        group_queries = gather_group_queries(queries, seen_ids, seen_lengths, target_ids, layout=table, device=device, group=group)
        if group_queries.total == 0:
            return torch.zeros(0, dtype=torch.long, device=queries.device)
        targets = group_queries.target_ids
        assert targets is not None
        target_rows = scored_rows(share_target_rows(table, targets, group), self.normalize_rows)
        scores_of_targets = target_scores(group_queries.queries, target_rows)
        seen = SeenItems.from_jagged(group_queries.seen_ids, group_queries.seen_lengths)
        counts = torch.zeros(group_queries.total, dtype=torch.long, device=device)
        block = ScoreBlock()
        for row_start, rows in self._row_chunks(table, group_queries.total, device, group):
            counts += count_at_least(block, group_queries.queries, rows, row_start, scores_of_targets, targets, seen)
        return sum_to_owners(counts, group_queries, group).to(queries.device)

    @torch.no_grad()
    def top_k(
        self, queries: torch.Tensor, k: int, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_k(k)
        if self._whole is not None:
            return self._whole.top_k(queries, k, seen_ids, seen_lengths)
        table = self._sharded_layout()
        device = table.device or queries.device
        group = self._sharding_group()
        group_queries = gather_group_queries(queries, seen_ids, seen_lengths, None, layout=table, device=device, group=group)
        width = min(k, table.num_items)
        own = group_queries.batch_sizes[group_queries.group_rank]
        if group_queries.total == 0:
            empty = torch.empty(0, width, device=queries.device)
            return empty.to(table.dtype), empty.to(torch.long)
        seen = SeenItems.from_jagged(group_queries.seen_ids, group_queries.seen_lengths)
        best = RunningTopK(group_queries.total, width, table.dtype, device)
        for row_start, rows in self._row_chunks(table, group_queries.total, device, group):
            best.add(group_queries.queries, rows, row_start, seen)
        best_scores, best_ids = best.result()
        # Pad to one width for the exchange: -inf and an id past the table sort after every real item.
        missing = width - best_scores.shape[1]
        best_scores = torch.cat([best_scores, best_scores.new_full((group_queries.total, missing), -torch.inf)], 1)
        best_ids = torch.cat([best_ids, best_ids.new_full((group_queries.total, missing), table.num_items)], 1)
        scores, ids = top_k_to_owners(best_scores, best_ids, group_queries, group)
        scores, ids = merge_top_k(scores, ids, width)
        assert scores.shape == (own, width)
        return scores.to(queries.device), ids.to(queries.device)

    def _sharded_layout(self) -> ShardedTableLayout:
        assert self._layout is not None
        return self._layout

    def _sharding_group(self) -> dist.ProcessGroup:
        assert self.group is not None  # read_table refused a sharded table without one
        return self.group

    def _row_chunks(
        self, table: ShardedTableLayout, num_queries: int, device: torch.device, group: dist.ProcessGroup
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """``(first row id, full rows as scored)`` of every chunk this rank scores for the group's ``num_queries``;
        the same chunks, so the same collectives, on every rank (``num_queries`` is the group's)."""
        step = rows_per_chunk(num_queries, table.dtype.itemsize, self.chunk_rows, self.block_bytes)
        for shard in table.full_rows:
            for start in range(0, shard.num_rows, step):
                yield shard.row_start + start, scored_rows(shard.values[start : start + step], self.normalize_rows)
        for sliced in table.column_sliced:
            for row_start, rows in _assembled_rows(sliced, table, step, device, group):
                yield row_start, scored_rows(rows, self.normalize_rows)


def _assembled_rows(
    sliced: ColumnSlicedRows, table: ShardedTableLayout, chunk_rows: int, device: torch.device, group: dist.ProcessGroup
) -> Iterator[tuple[int, torch.Tensor]]:
    """Full rows of a column-sliced range: per chunk of ``chunk_rows * group size`` rows, one all-to-all gives
    each rank every rank's columns of its part (at most ``chunk_rows`` rows)."""
    group_size, me = dist.get_world_size(group), dist.get_rank(group)
    widths = [sliced.width_of(rank) for rank in range(group_size)]
    span = chunk_rows * group_size
    for start in range(0, sliced.num_rows, span):
        rows = min(span, sliced.num_rows - start)
        parts = [rows // group_size + (1 if rank < rows % group_size else 0) for rank in range(group_size)]
        pieces = [shard.values[start : start + rows] for shard in sliced.local]
        send = torch.cat(pieces, 1) if pieces else torch.empty(rows, 0, dtype=table.dtype, device=device)
        received = torch.empty(parts[me] * sum(widths), dtype=table.dtype, device=device)
        send = send.to(device).contiguous().reshape(-1)
        dist.all_to_all_single(received, send, [parts[me] * w for w in widths], [p * widths[me] for p in parts], group=group)
        full = torch.empty(parts[me], table.dim, dtype=table.dtype, device=device)
        offset = 0
        for rank, width in enumerate(widths):
            block = received[offset : offset + parts[me] * width].reshape(parts[me], width)
            offset += parts[me] * width
            column = 0
            for col_start, slice_width in sliced.columns_by_rank[rank]:
                full[:, col_start : col_start + slice_width] = block[:, column : column + slice_width]
                column += slice_width
        if parts[me]:
            yield sliced.row_start + start + sum(parts[:me]), full


def make_item_ranking(
    module: nn.Module,
    table_name: str,
    *,
    process_group: dist.ProcessGroup | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    normalize_rows: bool = False,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> ItemRanking:
    """The ranking of ``table_name`` in ``module``: ``ShardedItemRanking`` over ``process_group`` for a
    TorchRec-sharded module, ``UnshardedItemRanking`` over the table's weight for a plain ``EmbeddingCollection``."""
    if isinstance(module, ShardedModule):
        if process_group is None:
            raise ValueError(f"{type(module).__name__} is sharded: pass process_group, the sharding group of its tables.")
        return ShardedItemRanking(module, table_name, process_group, chunk_rows, normalize_rows, block_bytes)
    table = read_table(module, table_name, None)
    assert isinstance(table, torch.Tensor)  # a plain module's state holds plain tensors
    return UnshardedItemRanking(table, chunk_rows, normalize_rows, block_bytes)

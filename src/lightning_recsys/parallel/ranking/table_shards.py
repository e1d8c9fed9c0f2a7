"""Where a sharded table's rows are, read the public way: the module's ``state_dict()`` ``ShardedTensor``.

Its global metadata (``metadata().shards_metadata``: offsets, sizes, placement of every shard) is the same on
every rank, so every rank derives the same layout, and the collectives that follow from it line up.
Its ``local_shards()`` are this rank's pieces. A shard that spans the full width (table-wise, row-wise) is
scored where it is; shards that hold column slices (column-wise, table-wise-column-wise) are grouped by
their row range, whose full rows are put together chunk by chunk (``ranking.sharded``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor


@dataclass(frozen=True)
class LocalShard:
    """One piece of the table on this rank: rows ``row_start ..``, columns ``col_start ..``."""

    row_start: int
    col_start: int
    values: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.values.shape[0]


@dataclass(frozen=True)
class ColumnSlicedRows:
    """A row range whose columns are cut into slices held by several ranks of the group.

    ``columns_by_rank[r]``: the ``(col_start, width)`` slices group rank ``r`` holds, in column order (it
    sends them concatenated in that order); ``local``: this rank's slices, in the same order.
    """

    row_start: int
    num_rows: int
    columns_by_rank: tuple[tuple[tuple[int, int], ...], ...]
    local: tuple[LocalShard, ...]

    def width_of(self, group_rank: int) -> int:
        return sum(width for _, width in self.columns_by_rank[group_rank])


@dataclass(frozen=True)
class ShardedTableLayout:
    """A table ``[num_items, dim]`` sharded over a group: this rank's full-row shards and the column-sliced ranges."""

    name: str
    num_items: int
    dim: int
    dtype: torch.dtype
    device: torch.device | None  # of this rank's shards; None when it holds none
    full_rows: tuple[LocalShard, ...]
    column_sliced: tuple[ColumnSlicedRows, ...]
    local: tuple[LocalShard, ...]  # every local piece (full rows and column slices)
    signature: int  # of the global shard metadata: equal on the ranks of the right group, different across replicas


def read_table(
    module: nn.Module, table_name: str, group: dist.ProcessGroup | None
) -> torch.Tensor | ShardedTableLayout:
    """``table_name``'s weight in an ``EmbeddingCollection`` (sharded or not), from one ``state_dict()``: the
    whole tensor when this rank holds it whole (unsharded or data-parallel), else its layout over ``group``,
    the table's sharding group. Either holds this rank's tensors as the module holds them, not copies."""
    state = module.state_dict()
    key = _table_key(module, list(state), table_name)
    value = state[key]
    if not isinstance(value, ShardedTensor):
        return value.detach()
    if group is None:
        raise ValueError(f"{key!r} is sharded: pass process_group, the sharding group the table is sharded over.")
    return _layout(key, value, group)


def _table_key(module: nn.Module, keys: list[str], table_name: str) -> str:
    """The state-dict key of ``table_name``'s weight among ``keys``."""
    suffix = f"embeddings.{table_name}.weight"
    matches = [k for k in keys if k == suffix or k.endswith("." + suffix)]
    if len(matches) != 1:
        tables = sorted({k.split(".")[-2] for k in keys if k.endswith(".weight") and "embeddings." in k})
        found = "none" if not matches else f"several: {matches}"
        raise ValueError(
            f"table_name={table_name!r}: {type(module).__name__} must hold exactly one table of that name ({found}); "
            f"its tables are {tables}. Pass the EmbeddingCollection that holds the table (after sharding, the "
            "ShardedEmbeddingCollection in its place) and one of its table names."
        )
    return matches[0]


def _layout(name: str, table: ShardedTensor, group: dist.ProcessGroup) -> ShardedTableLayout:
    num_items, dim = table.size()
    group_ranks = dist.get_process_group_ranks(group)
    local = tuple(
        LocalShard(int(s.metadata.shard_offsets[0]), int(s.metadata.shard_offsets[1]), s.tensor.detach())
        for s in sorted(table.local_shards(), key=lambda s: tuple(s.metadata.shard_offsets))
        if s.tensor.shape[0] > 0
    )
    by_rows: dict[tuple[int, int], list[tuple[int, int, int]]] = defaultdict(list)  # (row, rows) -> [(col, width, rank)]
    shards = table.metadata().shards_metadata
    placements = [shard.placement.rank() if shard.placement is not None else -1 for shard in shards]
    signature = hash(tuple(sorted((*s.shard_offsets, *s.shard_sizes, p) for s, p in zip(shards, placements))))
    full_row_ranges = []
    for shard, placed in zip(shards, placements):
        row, col = (int(v) for v in shard.shard_offsets)
        rows, width = (int(v) for v in shard.shard_sizes)
        if rows == 0:
            continue
        if width == dim:
            full_row_ranges.append((row, rows))
            continue
        if placed not in group_ranks:
            raise ValueError(
                f"a shard of {name!r} is placed on rank {placed}, which is not in the process group given (ranks "
                f"{group_ranks}): pass the process group the table is sharded over (under 2D, this rank's sharding group)."
            )
        by_rows[(row, rows)].append((col, width, group_ranks.index(placed)))
    ranges = sorted(full_row_ranges + list(by_rows))
    if [row for row, _ in ranges] != [0, *(row + rows for row, rows in ranges[:-1])] or sum(rows for _, rows in ranges) != num_items:
        # Each row must be scored once in the group: a row held twice would be counted twice.
        raise ValueError(f"the shards of {name!r} do not cover its {num_items} rows once ((first row, rows): {ranges}).")
    column_sliced = []
    for (row, rows), slices in sorted(by_rows.items()):
        slices.sort()
        ends = [col + width for col, width, _ in slices]
        if [col for col, _, _ in slices] != [0, *ends[:-1]] or ends[-1] != dim:
            raise ValueError(
                f"the column shards of {name!r} over rows {row}..{row + rows - 1} do not tile its {dim} columns "
                f"((col, width, group rank): {slices}); full ranking needs each row's slices to cover it once."
            )
        columns = tuple(tuple((c, w) for c, w, r in slices if r == rank) for rank in range(len(group_ranks)))
        mine = tuple(s for s in local if s.values.shape[1] < dim and s.row_start == row and s.num_rows == rows)
        column_sliced.append(ColumnSlicedRows(row, rows, columns, mine))
    return ShardedTableLayout(
        name=name,
        num_items=num_items,
        dim=dim,
        dtype=table.dtype,
        device=local[0].values.device if local else None,
        full_rows=tuple(s for s in local if s.values.shape[1] == dim),
        column_sliced=tuple(column_sliced),
        local=local,
        signature=signature,
    )

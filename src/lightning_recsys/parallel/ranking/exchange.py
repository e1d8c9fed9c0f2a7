"""The collectives of the sharded ranking, inside one sharding group.

Ranks may bring different batch sizes (0 included): sizes are all-gathered first, then each tensor is padded
to the group's largest and all-gathered, and the padding dropped. Every rank checks its own inputs before any
of that and says so in the size exchange, so a bad input stops the whole group with an error instead of
leaving its peers waiting in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_recsys.parallel.ranking.table_shards import ShardedTableLayout
from lightning_recsys.ranking.unsharded import ranking_input_problem


@dataclass(frozen=True)
class GroupQueries:
    """Every query of the group, in group-rank order, and which of them are this rank's."""

    queries: torch.Tensor  # [Q, D]
    target_ids: torch.Tensor | None  # [Q]
    seen_ids: torch.Tensor  # jagged by seen_lengths
    seen_lengths: torch.Tensor  # [Q]
    batch_sizes: tuple[int, ...]  # per group rank
    group_rank: int

    @property
    def total(self) -> int:
        return sum(self.batch_sizes)

    @property
    def own(self) -> slice:
        start = sum(self.batch_sizes[: self.group_rank])
        return slice(start, start + self.batch_sizes[self.group_rank])


def gather_group_queries(
    queries: torch.Tensor,
    seen_ids: torch.Tensor,
    seen_lengths: torch.Tensor,
    target_ids: torch.Tensor | None,
    *,
    layout: ShardedTableLayout,
    device: torch.device,
    group: dist.ProcessGroup,
) -> GroupQueries:
    """All-gather the group's queries, targets and seen ids (three collectives after the sizes)."""
    problem = ranking_input_problem(
        queries, seen_ids, seen_lengths, num_items=layout.num_items, dim=layout.dim, target_ids=target_ids
    )
    batch = queries.shape[0] if queries.dim() == 2 else 0
    header = torch.tensor([batch, seen_ids.numel(), problem is not None, layout.signature], dtype=torch.long, device=device)
    headers = _all_gather_equal(header, group)
    bad = [rank for rank, h in enumerate(headers) if h[2]]
    if bad:
        raise ValueError(problem or f"the ranking inputs of group rank(s) {bad} are invalid (their error says why); the group stops.")
    if len({int(h[3]) for h in headers}) > 1:
        raise ValueError(
            f"the ranks of the process group given hold different shards of {layout.name!r} (replicas): pass the "
            "table's sharding group (under 2D, ParallelTopology.sharding_process_group()), not the world."
        )
    batch_sizes = tuple(int(h[0]) for h in headers)
    seen_counts = [int(h[1]) for h in headers]
    ints = [seen_lengths] + ([target_ids] if target_ids is not None else [])
    per_query = _all_gather_rows(torch.stack([i.to(device=device, dtype=torch.long) for i in ints], 1), batch_sizes, group)
    return GroupQueries(
        queries=_all_gather_rows(queries.to(device=device, dtype=layout.dtype).reshape(batch, layout.dim), batch_sizes, group),
        target_ids=per_query[:, 1] if target_ids is not None else None,
        seen_ids=_all_gather_rows(seen_ids.to(device=device, dtype=torch.long), seen_counts, group),
        seen_lengths=per_query[:, 0],
        batch_sizes=batch_sizes,
        group_rank=dist.get_rank(group),
    )


def share_target_rows(layout: ShardedTableLayout, target_ids: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[Q, D]``: every query's full target row, on every rank of the group.

    Each rank writes the pieces of the target rows it holds into zeros, and a sum all-reduce puts them
    together; every value has one holder in the group, so adding the others' zeros keeps it exact.
    """
    rows = torch.zeros(target_ids.shape[0], layout.dim, dtype=layout.dtype, device=target_ids.device)
    for shard in layout.local:
        local = target_ids - shard.row_start
        held = (local >= 0) & (local < shard.num_rows)
        columns = slice(shard.col_start, shard.col_start + shard.values.shape[1])
        rows[held, columns] = shard.values[local[held]].to(rows.device)
    dist.all_reduce(rows, group=group)
    return rows


def sum_to_owners(counts: torch.Tensor, group_queries: GroupQueries, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's queries' counts summed over the group (``[Q]`` int64 per rank in; ``[B]`` out)."""
    dist.all_reduce(counts, group=group)
    return counts[group_queries.own]


def top_k_to_owners(
    scores: torch.Tensor, ids: torch.Tensor, group_queries: GroupQueries, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's ``[Q, k]`` candidates of every group query to the query's owner: ``[B, group_size * k]`` each."""
    sizes, own = list(group_queries.batch_sizes), group_queries.batch_sizes[group_queries.group_rank]
    width = scores.shape[1]
    received = []
    for candidates in (scores, ids):
        output = candidates.new_empty(own * len(sizes), width)
        dist.all_to_all_single(output, candidates.contiguous(), [own] * len(sizes), sizes, group=group)
        received.append(output.reshape(len(sizes), own, width).transpose(0, 1).reshape(own, len(sizes) * width))
    return received[0], received[1]


def _all_gather_equal(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return gathered


def _all_gather_rows(tensor: torch.Tensor, sizes: tuple[int, ...] | list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The ranks' ``tensor`` (``sizes[r]`` rows on rank ``r``) concatenated in rank order, padded for the collective."""
    largest = max(sizes)
    if largest == 0:  # every rank knows it: all skip the collective
        return tensor.new_empty(0, *tensor.shape[1:])
    padded = torch.cat([tensor, tensor.new_zeros(largest - tensor.shape[0], *tensor.shape[1:])])
    gathered = _all_gather_equal(padded.contiguous(), group)
    return torch.cat([piece[:size] for piece, size in zip(gathered, sizes)])

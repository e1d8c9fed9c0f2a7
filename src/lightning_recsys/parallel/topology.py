"""The rank layout: which ranks shard the tables together and which hold replicas of each other.

This module is the one owner of the parallel degrees. A sharding group is the set of ranks the
embedding tables are sharded over (the all-to-all runs inside it); a replica group is the set of
ranks that hold the same shard in different sharding groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist

Layout = Literal["all_to_all_optimized", "all_reduce_optimized"]
LAYOUTS: tuple[str, ...] = ("all_to_all_optimized", "all_reduce_optimized")


@dataclass(frozen=True, kw_only=True)
class ParallelTopology:
    """Rank layout for ``world_size`` ranks split into sharding groups of ``sharding_group_size``.

    ``all_to_all_optimized`` makes sharding groups contiguous ranks (one node each when the group
    size equals the devices per node); ``all_reduce_optimized`` strides them across nodes.
    ``sharding_group_size == world_size`` is plain 1D sharding.
    """

    world_size: int
    sharding_group_size: int
    layout: Layout = "all_to_all_optimized"
    _groups: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1.")
        if self.sharding_group_size < 1:
            raise ValueError(f"sharding_group_size={self.sharding_group_size} must be >= 1.")
        if self.sharding_group_size > self.world_size:
            raise ValueError(
                f"sharding_group_size={self.sharding_group_size} is larger than the world size "
                f"({self.world_size}); use at most {self.world_size}."
            )
        if self.world_size % self.sharding_group_size:
            divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
            raise ValueError(
                f"sharding_group_size={self.sharding_group_size} must divide the world size "
                f"({self.world_size}); valid sizes are {divisors}."
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {list(LAYOUTS)}.")

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.sharding_group_size

    @property
    def is_1d(self) -> bool:
        return self.num_replicas == 1

    def sharding_groups(self) -> list[list[int]]:
        """All sharding groups, as lists of global ranks; the index is the replica index."""
        size, replicas = self.sharding_group_size, self.num_replicas
        if self.layout == "all_to_all_optimized":
            return [list(range(r * size, (r + 1) * size)) for r in range(replicas)]
        return [list(range(r, self.world_size, replicas)) for r in range(replicas)]

    def replica_groups(self) -> list[list[int]]:
        """All replica groups: the i-th rank of every sharding group."""
        groups = self.sharding_groups()
        return [[group[i] for group in groups] for i in range(self.sharding_group_size)]

    def sharding_group_of(self, rank: int) -> list[int]:
        return next(g for g in self.sharding_groups() if rank in g)

    def replica_group_of(self, rank: int) -> list[int]:
        return next(g for g in self.replica_groups() if rank in g)

    def local_shard_rank(self, rank: int) -> int:
        """The rank's index inside its sharding group (what TorchRec's plan calls its rank)."""
        return self.sharding_group_of(rank).index(rank)

    def sharding_process_group(self) -> dist.ProcessGroup:
        """The process group of this rank's sharding group (WORLD when 1D). Creates it on first use.

        Every rank must call this the first time, since ``new_subgroups_by_enumeration`` is collective.
        """
        if self.is_1d:
            return dist.group.WORLD
        if "shard" not in self._groups:
            group, _ = dist.new_subgroups_by_enumeration(self.sharding_groups())
            self._groups["shard"] = group
        return self._groups["shard"]  # type: ignore[return-value]

    def replica_process_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's replica group; None when 1D (no replicas to sync)."""
        if self.is_1d:
            return None
        if "replicate" not in self._groups:
            group, _ = dist.new_subgroups_by_enumeration(self.replica_groups())
            self._groups["replicate"] = group
        return self._groups["replicate"]  # type: ignore[return-value]

"""The rank layout: which ranks shard the tables together and which hold replicas of each other.

This module is the one owner of the parallel degrees. A sharding group is the set of ranks the
embedding tables are sharded over (the all-to-all runs inside it); a replica group is the set of
ranks that hold the same shard in different sharding groups. The two are the axes of one
``DeviceMesh``: ``("replicate", "shard")``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Layout = Literal["all_to_all_optimized", "all_reduce_optimized"]
LAYOUTS: tuple[str, ...] = ("all_to_all_optimized", "all_reduce_optimized")


class MeshAxis(str, Enum):
    """Names of the device-mesh axes, used everywhere a mesh dimension is named."""

    REPLICATE = "replicate"
    SHARD = "shard"


MESH_AXES: tuple[str, str] = (MeshAxis.REPLICATE.value, MeshAxis.SHARD.value)


@dataclass(frozen=True, kw_only=True)
class ParallelTopology:
    """Rank layout for ``world_size`` ranks split into sharding groups of ``sharding_group_size``.

    ``all_to_all_optimized`` makes sharding groups contiguous ranks (one node each when the group
    size equals the devices per node), so the embedding all-to-all stays inside a node and the
    replica all-reduce crosses nodes. ``all_reduce_optimized`` strides the groups across nodes: the
    all-to-all crosses nodes and replicas sit inside a node. ``sharding_group_size == world_size`` is
    plain 1D sharding. ``ranks_per_node`` (default: the whole world on one node) tells which
    collectives cross a node boundary.
    """

    world_size: int
    sharding_group_size: int
    layout: Layout = "all_to_all_optimized"
    ranks_per_node: int | None = None
    _mesh: dict[str, DeviceMesh] = field(default_factory=dict, compare=False, repr=False)

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
            raise ValueError(
                f"sharding_group_size={self.sharding_group_size} must divide the world size "
                f"({self.world_size}); valid sizes are {_divisors(self.world_size)}."
            )
        check_topology_arguments(self.sharding_group_size, self.layout)
        if self.ranks_per_node is not None and (self.ranks_per_node < 1 or self.world_size % self.ranks_per_node):
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} must be >= 1 and divide the world size ({self.world_size})."
            )

    @classmethod
    def for_world(
        cls, *, ranks_per_node: int, num_nodes: int, sharding_group_size: int | None = None, layout: Layout = "all_to_all_optimized"
    ) -> ParallelTopology:
        """The layout for ``num_nodes`` nodes of ``ranks_per_node`` ranks; the group size defaults to a node."""
        check_topology_arguments(sharding_group_size, layout)
        world = ranks_per_node * num_nodes
        group_size = sharding_group_size or ranks_per_node
        if world % group_size:
            raise ValueError(
                f"sharding_group_size={group_size} must divide the world size {world} "
                f"(devices={ranks_per_node} x num_nodes={num_nodes}); valid sizes are {_divisors(world)}."
            )
        return cls(world_size=world, sharding_group_size=group_size, layout=layout, ranks_per_node=ranks_per_node)

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.sharding_group_size

    @property
    def is_1d(self) -> bool:
        return self.num_replicas == 1

    @property
    def node_size(self) -> int:
        return self.ranks_per_node or self.world_size

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

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def spans_nodes(self, ranks: list[int] | tuple[int, ...]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

    @property
    def writer_group(self) -> list[int]:
        """Sharding group 0: the ranks that write the tables of a checkpoint (replicas hold the same)."""
        return self.sharding_groups()[0]

    def local_rank(self, rank: int) -> int:
        """The rank's index on its node."""
        return rank % self.node_size

    @property
    def group_ranks_per_node(self) -> int:
        """How many ranks of one sharding group share a node (TorchRec's ``local_world_size``)."""
        group = self.sharding_groups()[0]
        return sum(1 for r in group if self.node_of(r) == self.node_of(group[0]))

    def describe(self) -> str:
        """One line for logs: 1D, or the 2D layout with its sharding and replica groups."""
        if self.is_1d:
            return f"1D sharding over {self.world_size} ranks"
        return (
            f"2D {self.layout}: {self.num_replicas} replicas x sharding groups of {self.sharding_group_size} "
            f"ranks; sharding groups {self.sharding_groups()}, replica groups {self.replica_groups()}"
        )

    def layout_warnings(self) -> list[str]:
        """Layouts that work but defeat their purpose; the strategy logs these."""
        if self.is_1d or self.ranks_per_node is None:
            return []
        name = "sharding group" if self.layout == "all_to_all_optimized" else "replica group"
        groups = self.sharding_groups() if self.layout == "all_to_all_optimized" else self.replica_groups()
        if any(self.spans_nodes(g) for g in groups):
            return [
                f"layout={self.layout!r} with sharding_group_size={self.sharding_group_size} and "
                f"{self.ranks_per_node} ranks per node puts a {name} across nodes, so the traffic this layout "
                "keeps inside a node will cross the network."
            ]
        return []

    # ----------------------------------------------------------------- process groups
    def device_mesh(self, device_type: str, *, timeout: timedelta | None = None) -> DeviceMesh:
        """The ``("replicate", "shard")`` mesh; row i is sharding group i. Collective on first call.

        ``timeout`` bounds every collective on the mesh's groups (the backend's default otherwise)."""
        if "mesh" not in self._mesh:
            if not dist.is_initialized():
                raise RuntimeError("ParallelTopology.device_mesh() needs an initialized default process group.")
            if dist.get_world_size() != self.world_size:
                raise ValueError(
                    f"ParallelTopology(world_size={self.world_size}) does not match the process group's world "
                    f"size ({dist.get_world_size()})."
                )
            mesh = DeviceMesh(device_type, torch.tensor(self.sharding_groups()), mesh_dim_names=MESH_AXES)
            if timeout is not None:
                _bound_group_timeouts(mesh, timeout)
            self._mesh["mesh"] = mesh
        return self._mesh["mesh"]

    def sharding_process_group(self) -> dist.ProcessGroup:
        """This rank's sharding group, from the mesh (call ``device_mesh`` first on every rank)."""
        return self._built_mesh().get_group(MeshAxis.SHARD.value)

    def replica_process_group(self) -> dist.ProcessGroup | None:
        """This rank's replica group; None when 1D (no replicas to sync)."""
        if self.is_1d:
            return None
        return self._built_mesh().get_group(MeshAxis.REPLICATE.value)

    def _built_mesh(self) -> DeviceMesh:
        if "mesh" not in self._mesh:
            raise RuntimeError("ParallelTopology.device_mesh(device_type) must be called (on every rank) first.")
        return self._mesh["mesh"]


def _bound_group_timeouts(mesh: DeviceMesh, timeout: timedelta) -> None:
    """Give the mesh's subgroups the job's collective timeout.

    Workaround (torch 2.13): DeviceMesh makes its subgroups with ``new_group(timeout=None)``
    (``_init_one_process_group`` in torch/distributed/device_mesh.py passes only a pg_options
    timeout), i.e. the backend's default, 30 minutes for gloo, not ``init_process_group``'s: with a
    lost link, collectives on the replica group then waited up to half an hour instead of the timeout.
    """
    for axis in MESH_AXES:
        group = mesh.get_group(axis)
        if group is not dist.group.WORLD:  # WORLD already has it, from init_process_group
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def check_topology_arguments(sharding_group_size: int | None, layout: str) -> None:
    """Raise if the requested group size or layout cannot be right on any world."""
    if sharding_group_size is not None and (
        isinstance(sharding_group_size, bool) or not isinstance(sharding_group_size, int) or sharding_group_size < 1
    ):
        raise ValueError(
            f"sharding_group_size={sharding_group_size!r} must be an integer >= 1, or None for the devices per node."
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {list(LAYOUTS)}.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

"""TorchRec's own planner (``EmbeddingShardingPlanner``), and what every planner here hands it.

* ``embedding_tables``: the tables of a module, as TorchRec's planner enumerates them (``planner.tables``);
* ``torchrec_topology``: TorchRec's ``Topology`` of one sharding group (no process group needed);
* ``quiet_torchrec_planner``: drops a warning TorchRec logs for every data-parallel table;
* ``torchrec_planner`` / ``make_sharding_plan``: TorchRec's default planner on our constraints
  and traffic statistics, in this process or on rank 0 for every rank.

No Lightning imports.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping

from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import KernelConfig, Topology, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from lightning_recsys.planner.collective import plan_for_every_rank
from lightning_recsys.planner.constraints import TableConstraints, pooling_factor_defaults, torchrec_constraints
from lightning_recsys.planner.shard_cost import storage_tier
from lightning_recsys.planner.stats import LoadProfile, TableStats, resolve_table_stats
from lightning_recsys.planner.tables import ModelTables, embedding_tables, model_tables

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "QuietEmbeddingShardingPlanner",
    "embedding_tables",  # re-exported: it lives in planner.tables
    "make_sharding_plan",
    "quiet_torchrec_planner",
    "torchrec_planner",
    "torchrec_topology",
]

DEFAULT_BATCH_SIZE = 512  # TorchRec's planner default (torchrec.distributed.planner.constants.BATCH_SIZE)


class _DropMissingSpecWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Sharding spec not found for ")


@contextlib.contextmanager
def quiet_torchrec_planner() -> Iterator[None]:
    """Drop TorchRec's per-table root-logger warning for data-parallel tables while planning.

    TorchRec's ``validate_rank_assignment`` logs "Sharding spec not found" (root logger, WARNING)
    for every data-parallel table, whose plan has no sharding spec by design.
    """
    handler_filter = _DropMissingSpecWarnings()
    root = logging.getLogger()
    root.addFilter(handler_filter)
    try:
        yield
    finally:
        root.removeFilter(handler_filter)


def torchrec_topology(
    sharding_group_size: int,
    group_ranks_per_node: int | None,
    compute_device: str,
    memory_per_rank: int | None = None,
) -> Topology:
    """A TorchRec ``Topology`` for one sharding group (no process group needed)."""
    if sharding_group_size < 1:
        raise ValueError(f"sharding_group_size={sharding_group_size} must be >= 1.")
    local = min(group_ranks_per_node or sharding_group_size, sharding_group_size)
    if sharding_group_size % local:
        raise ValueError(
            f"group_ranks_per_node={group_ranks_per_node} must divide sharding_group_size={sharding_group_size} "
            "(a sharding group spans whole nodes or part of one node)."
        )
    memory: dict[str, int] = {}
    if memory_per_rank is not None:
        if memory_per_rank < 1:
            raise ValueError(f"memory_per_rank={memory_per_rank} must be >= 1 byte.")
        memory = {"hbm_cap_bytes" if storage_tier(compute_device) == "hbm" else "ddr_cap_bytes": int(memory_per_rank)}
    return TopologyFactory.create_topology(
        TrainerConfig(world_size=sharding_group_size, local_world_size=local, **memory),
        kernel_config=KernelConfig(compute_device=compute_device),
    )


class QuietEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's ``EmbeddingShardingPlanner`` without its per-table data-parallel warning."""

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        with quiet_torchrec_planner():
            return super().plan(module, sharders)


def torchrec_planner(
    tables: ModelTables,
    *,
    sharding_group_size: int,
    group_ranks_per_node: int | None,
    compute_device: str,
    batch_size: int | None = None,
    stats: Mapping[str, TableStats] | LoadProfile | None = None,
    constraints: Mapping[str, TableConstraints] | None = None,
    hash_partitions: Mapping[str, int] | None = None,
    memory_per_rank: int | None = None,
) -> EmbeddingShardingPlanner:
    """TorchRec's default planner for a module's ``tables``, told the same as ``BalancedPlanner`` is.

    It gets the batch size, each table's observed (or assumed) pooling factors through
    ``torchrec_constraints``, our per-table constraints and the hash-partitioned tables (row-wise).
    TorchRec's own stats table is not logged; ``build_plan_report`` describes the plan instead.
    """
    resolved, _ = resolve_table_stats(tables.configs, stats, pooling_factor_defaults(constraints))
    return QuietEmbeddingShardingPlanner(
        topology=torchrec_topology(sharding_group_size, group_ranks_per_node, compute_device, memory_per_rank),
        batch_size=batch_size or DEFAULT_BATCH_SIZE,
        constraints=torchrec_constraints(tables.configs, stats=resolved, table_constraints=constraints, hash_partitions=hash_partitions),
        stats=[],
        debug=False,
    )


def make_sharding_plan(
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    *,
    sharding_group_size: int,
    group_ranks_per_node: int,
    compute_device: str,
    constraints: dict[str, TableConstraints] | None = None,
    batch_size: int | None = None,
    stats: Mapping[str, TableStats] | LoadProfile | None = None,
) -> ShardingPlan:
    """Plan ``module`` for one sharding group with TorchRec's planner, on global rank 0, for every rank.

    The plan's ranks are group-local (0..sharding_group_size-1); see ``plan_for_every_rank``.
    """
    planner = torchrec_planner(
        model_tables(module),
        sharding_group_size=sharding_group_size,
        group_ranks_per_node=group_ranks_per_node,
        compute_device=compute_device,
        batch_size=batch_size,
        stats=stats,
        constraints=constraints,
    )
    return plan_for_every_rank(planner, module, sharders)

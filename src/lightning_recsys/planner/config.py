"""``PlanningConfig``: how a sharding plan is made. Read by the strategy and by ``lightning-recsys plan``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_recsys.parallel.sharding import validate_sharding_types
from lightning_recsys.planner.constraints import TableConstraints
from lightning_recsys.planner.stats import TableStats

PlannerName = Literal["torchrec", "balanced"]
PLANNERS: tuple[str, ...] = ("torchrec", "balanced")


@dataclass(kw_only=True)
class PlanningConfig:
    """How the sharding plan is made: which planner, what it may do, and what it is told about the tables.

    Both planners get the same batch size, statistics, constraints and hash partitions.

    Args:
        planner: ``"torchrec"`` (TorchRec's ``EmbeddingShardingPlanner``) or ``"balanced"``
            (``BalancedPlanner``: balances storage, lookups, all-to-all bytes and step time per rank).
        sharding_types: sharding types the planner may use for every table; default (None): all
            that run on the device (under 2D, all but ``table_row_wise``).
        table_constraints: per-table ``TableConstraints``, keyed by table name.
        table_stats: per-table ``TableStats`` (pooling factor, hot rows), keyed by table name;
            tables without any are assumed (their ``TableConstraints.pooling_factor``, else 1 id).
        profile_batches: measure the statistics on this many training batches first (rank 0), >= 0.
        hash_partitions: tables whose ids are hashed into P partitions, ``{"t_user": 64}``; they
            are sharded row-wise on partition boundaries, P / sharding group size per rank.
        reshape_tables: apply the reshape advice (halve the dim, double the rows, where that cuts
            the all-to-all bytes) to the model's tables before planning. Opt-in; changes the model.
    """

    planner: PlannerName = "torchrec"
    sharding_types: list[str] | None = None
    table_constraints: dict[str, TableConstraints] = field(default_factory=dict)
    table_stats: dict[str, TableStats] | None = None
    profile_batches: int = 0
    hash_partitions: dict[str, int] | None = None
    reshape_tables: bool = False

    def __post_init__(self) -> None:
        if self.planner not in PLANNERS:
            raise ValueError(f"PlanningConfig(planner={self.planner!r}) is not one of {list(PLANNERS)}.")
        if self.sharding_types is not None:
            if not self.sharding_types:
                raise ValueError("PlanningConfig(sharding_types=[]) allows no sharding type; pass None to allow all.")
            validate_sharding_types(list(self.sharding_types), "cuda", "PlanningConfig(sharding_types)")
        if isinstance(self.profile_batches, bool) or not isinstance(self.profile_batches, int) or self.profile_batches < 0:
            raise ValueError(f"PlanningConfig(profile_batches={self.profile_batches!r}) must be an integer >= 0.")
        for name, value in self.table_constraints.items():
            if not isinstance(value, TableConstraints):
                raise TypeError(f"table_constraints[{name!r}] must be a TableConstraints, got {type(value).__name__}.")
        for name, value in (self.table_stats or {}).items():
            if not isinstance(value, TableStats):
                raise TypeError(f"table_stats[{name!r}] must be a TableStats, got {type(value).__name__}.")
        for name, value in (self.hash_partitions or {}).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hash_partitions[{name!r}]={value!r} must be an integer >= 1.")
        if self.hash_partitions and self.sharding_types is not None and "row_wise" not in self.sharding_types:
            raise ValueError(
                f"PlanningConfig(hash_partitions={self.hash_partitions!r}) shards those tables row-wise, but "
                f"sharding_types={self.sharding_types!r} does not allow 'row_wise'; add it, or drop hash_partitions."
            )

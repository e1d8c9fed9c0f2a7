"""BalancedPlanner: TorchRec's planner loop over the balanced enumerator, proposer, partitioner and perf model.

No Lightning imports.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import PlannerError, ShardingOption, StorageReservation
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardingPlan,
    ShardingPlanner,
    ShardingType,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from lightning_recsys.planner.balanced.context import BalanceContext
from lightning_recsys.planner.balanced.enumerator import BalancedEnumerator
from lightning_recsys.planner.balanced.partitioner import BalancedPartitioner
from lightning_recsys.planner.balanced.perf_model import BalancedPerfModel
from lightning_recsys.planner.balanced.proposer import BalancedProposer
from lightning_recsys.planner.collective import plan_for_every_rank
from lightning_recsys.planner.constraints import (
    TableConstraints,
    check_hash_partitions,
    pooling_factor_defaults,
    torchrec_constraints,
)
from lightning_recsys.planner.shard_cost import (
    BalanceObjective,
    CommCosts,
    format_bytes,
    shard_storage,
    storage_tier,
    tier_bytes,
)
from lightning_recsys.planner.stats import LoadProfile, TableStats, profile_datamodule, resolve_table_stats
from lightning_recsys.planner.tables import ModelTables, model_tables
from lightning_recsys.planner.torchrec_planner import DEFAULT_BATCH_SIZE, quiet_torchrec_planner, torchrec_topology

DEFAULT_COMPUTE_KERNELS: tuple[str, ...] = ("fused", "dense")  # dense: TorchRec's data-parallel kernel


@dataclass
class PlanResult:
    """The plan and the state the planner saw, for reports."""

    plan: ShardingPlan
    stats: dict[str, TableStats]
    assumed_stats: set[str]
    constraints: dict[str, ParameterConstraints]
    comm: CommCosts
    rating: float
    rounds: int
    proposals: int


class BalancedPlanner(ShardingPlanner):
    """A TorchRec planner that balances storage, lookups, comm bytes and step time across one sharding group.

    Args:
        sharding_group_size: ranks the tables are sharded over (one node in 2D).
        group_ranks_per_node: ranks of the group per node (default: the whole group on one node).
        compute_device: ``cpu`` or ``cuda`` (``cuda`` plans work without a GPU).
        batch_size: examples per rank per step.
        stats: per-table traffic (``TableStats`` by table name), a ``LoadProfile`` from
            ``BalancedPlanner.profile``, or None (TableConstraints' pooling factors, else 1.0).
        constraints: our per-table ``TableConstraints``.
        hash_partitions: table name -> P: the table's ids are hashed into P equal partitions of
            contiguous rows; it is sharded row-wise with P / G whole partitions per rank.
        comm_costs: wire formats; default: read from the sharders' QComms codecs at plan time.
        balance: the objective: weights of storage, lookups, comm and step time, and the imbalance tolerance.
        memory_per_rank: bytes of HBM (CUDA) or DDR (CPU) per rank; default TorchRec's (32 GiB
            HBM, 128 GiB DDR). ``storage_reservation`` keeps a share of it for the rest of the
            model (default: 15% of HBM).
        min_column_width, max_column_shards: the finest column-wise splits considered (TorchRec's
            own enumerator stops at 128 columns; balance across many ranks needs narrower ones).
        compute_kernels: kernels every table may use unless its TableConstraints say otherwise;
            default ``fused`` (and ``dense`` for data-parallel). The objective does not model the
            slower UVM/caching kernels, so they are used only where a table's constraints ask.
        max_rounds: rounds of the proposer's descents, in total.
        timeout_seconds: planning time limit; the best plan found by then is used.
        tables: the tables of the module it plans (``planner.tables.model_tables``), when the caller
            has read them already; default: read from the module at plan time.
    """

    def __init__(
        self,
        *,
        sharding_group_size: int,
        group_ranks_per_node: int | None = None,
        compute_device: str = "cpu",
        batch_size: int = DEFAULT_BATCH_SIZE,
        stats: Mapping[str, TableStats] | LoadProfile | None = None,
        constraints: Mapping[str, TableConstraints] | None = None,
        hash_partitions: Mapping[str, int] | None = None,
        comm_costs: CommCosts | None = None,
        balance: BalanceObjective | None = None,
        memory_per_rank: int | None = None,
        storage_reservation: StorageReservation | None = None,
        min_column_width: int = 4,
        max_column_shards: int | None = None,
        compute_kernels: Sequence[str] | None = None,
        max_rounds: int = 200,
        timeout_seconds: int | None = 300,
        tables: ModelTables | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"BalancedPlanner(batch_size={batch_size!r}) must be an integer >= 1 (examples per rank per step).")
        if compute_device not in ("cpu", "cuda", "mtia"):
            raise ValueError(f"BalancedPlanner(compute_device={compute_device!r}) must be 'cpu' or 'cuda'.")
        if max_rounds < 1:
            raise ValueError(f"BalancedPlanner(max_rounds={max_rounds}) must be >= 1.")
        if timeout_seconds is not None and timeout_seconds < 1:
            raise ValueError(f"BalancedPlanner(timeout_seconds={timeout_seconds}) must be >= 1, or None for no limit.")
        if min_column_width < 4 or min_column_width % 4:
            raise ValueError(f"BalancedPlanner(min_column_width={min_column_width}) must be a multiple of 4 (FBGEMM's row alignment).")
        if max_column_shards is not None and max_column_shards < 1:
            raise ValueError(f"BalancedPlanner(max_column_shards={max_column_shards}) must be >= 1, or None for the group size.")
        for name, value in (constraints or {}).items():
            if not isinstance(value, TableConstraints):
                raise TypeError(f"BalancedPlanner(constraints[{name!r}]) must be a TableConstraints, got {type(value).__name__}.")
        self.topology = torchrec_topology(sharding_group_size, group_ranks_per_node, compute_device, memory_per_rank)
        self.sharding_group_size = sharding_group_size
        self.group_ranks_per_node = self.topology.local_world_size
        self.compute_device = compute_device
        self.batch_size = batch_size
        self.stats = stats
        self.constraints = dict(constraints or {})
        self.hash_partitions = dict(hash_partitions or {})
        self.comm_costs = comm_costs
        self.balance = balance or BalanceObjective()
        self.storage_reservation = storage_reservation or FixedPercentageStorageReservation(percentage=0.15)
        self.min_column_width = min_column_width
        self.max_column_shards = max_column_shards
        self.compute_kernels = list(compute_kernels) if compute_kernels is not None else list(DEFAULT_COMPUTE_KERNELS)
        self.max_rounds = max_rounds
        self.timeout_seconds = timeout_seconds
        self.tables = tables  # the planned module's, when the caller has read them already
        self.last_result: PlanResult | None = None

    @staticmethod
    def profile(datamodule: Any, batches: int, *, setup: bool = True) -> LoadProfile:
        """Observed traffic of ``batches`` batches of ``datamodule.train_dataloader()`` (see ``profile_datamodule``).

        ``setup=True`` first calls ``datamodule.setup("fit")``; pass False where the Trainer already did.
        """
        return profile_datamodule(datamodule, batches, setup=setup)

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """Plan ``module``'s tables for one sharding group (group-local ranks), in this process.

        Raises ``ValueError`` for bad hash partitions or constraints, and TorchRec's ``PlannerError``,
        prefixed with which tables do not fit and by how much, when no plan fits in memory.
        """
        tables = list((self.tables if self.tables is not None else model_tables(module)).configs)
        stats, assumed = resolve_table_stats(tables, self.stats, pooling_factor_defaults(self.constraints))
        check_hash_partitions(self.hash_partitions, tables, self.sharding_group_size)
        self._check_row_wise_allowed(sharders)
        constraints = torchrec_constraints(
            tables,
            stats=stats,
            table_constraints=self.constraints,
            hash_partitions=self.hash_partitions,
            compute_kernels=self.compute_kernels,
        )
        comm = self.comm_costs or CommCosts.from_sharders(sharders)
        context = BalanceContext(
            stats=stats,
            batch_size=self.batch_size,
            group_size=self.sharding_group_size,
            comm=comm,
            balance=self.balance,
            tier=storage_tier(self.compute_device),
            intra_group_size=self.topology.intra_group_size,
        )
        enumerator = BalancedEnumerator(
            self.topology,
            self.batch_size,
            constraints,
            min_column_width=self.min_column_width,
            max_column_shards=self.max_column_shards,
        )
        proposer = BalancedProposer(context, max_rounds=self.max_rounds)
        reservation = copy.deepcopy(self.storage_reservation)
        planner = EmbeddingShardingPlanner(
            topology=self.topology,
            batch_size=self.batch_size,
            enumerator=enumerator,
            storage_reservation=reservation,
            proposer=proposer,
            partitioner=BalancedPartitioner(context),
            performance_model=BalancedPerfModel(context),
            stats=[],  # our PlanReport replaces TorchRec's stats table
            constraints=constraints,
            debug=False,
            timeout_seconds=self.timeout_seconds,  # TorchRec keeps the best plan found when time runs out
        )
        try:
            with quiet_torchrec_planner():
                plan = planner.plan(module, sharders)
        except PlannerError as err:
            raise PlannerError(
                self._explain_infeasible(enumerator.last_search_space, reservation, context) + "\n" + str(err),
                err.error_type,
            ) from err
        self._check_alignment(plan, tables)
        # TorchRec keeps the winning placed options only in the private `_best_plan` (no public accessor).
        best = planner._best_plan or []
        rating = BalancedPerfModel(context).rate(best) if best else 0.0
        self.last_result = PlanResult(
            plan=plan,
            stats=stats,
            assumed_stats=assumed,
            constraints=constraints,
            comm=comm,
            rating=rating,
            rounds=proposer.rounds_run,
            proposals=planner._num_proposals,
        )
        return plan

    def collective_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> ShardingPlan:
        """Plan on rank 0 of ``pg`` (default WORLD) for every rank; a planning error is raised on every rank.

        See ``lightning_recsys.planner.collective.plan_for_every_rank``.
        """
        if sharders is None:
            raise ValueError("BalancedPlanner.collective_plan needs the sharders (the same ones DMP gets).")
        return plan_for_every_rank(self, module, sharders, pg)

    # -- checks
    def _check_row_wise_allowed(self, sharders: Sequence[ModuleSharder[nn.Module]]) -> None:
        if not self.hash_partitions:
            return
        for sharder in sharders:
            if sharder.module_type is EmbeddingBagCollection:
                types = sharder.sharding_types(self.compute_device)
                if ShardingType.ROW_WISE.value not in types:
                    raise ValueError(
                        f"hash_partitions={self.hash_partitions} needs row-wise sharding, but the sharders allow only {types}; "
                        "allow 'row_wise' in sharding_types."
                    )

    def _check_alignment(self, plan: ShardingPlan, tables: Sequence[BaseEmbeddingConfig]) -> None:
        rows_of = {t.name: t.num_embeddings for t in tables}
        for module_plan in plan.plan.values():
            if not isinstance(module_plan, EmbeddingModuleShardingPlan):
                continue
            for name, sharding in module_plan.items():
                if name not in self.hash_partitions:
                    continue
                partition_rows = rows_of[name] // self.hash_partitions[name]
                spec = sharding.sharding_spec
                shards = getattr(spec, "shards", None) or []
                per_rank = self.hash_partitions[name] // self.sharding_group_size
                if sharding.sharding_type != ShardingType.ROW_WISE.value or any(
                    s.shard_offsets[0] % partition_rows or s.shard_sizes[0] != per_rank * partition_rows for s in shards
                ):
                    raise RuntimeError(
                        f"internal error: table {name!r} is not sharded row-wise on its {self.hash_partitions[name]} "
                        f"hash partitions ({sharding.sharding_type}, shards {[(s.shard_offsets, s.shard_sizes) for s in shards]})."
                    )

    def _explain_infeasible(
        self, search_space: Sequence[ShardingOption], reservation: StorageReservation, context: BalanceContext
    ) -> str:
        tier = context.tier
        reserved = reservation.last_reserved_topology or self.topology
        capacity = min(tier_bytes(d.storage, tier) for d in reserved.devices)
        per_table: dict[str, tuple[int, int, str]] = {}
        for option in search_space:
            biggest = max(tier_bytes(shard_storage(s), tier) for s in option.shards)
            total = sum(tier_bytes(shard_storage(s), tier) for s in option.shards)
            known = per_table.get(option.name)
            if known is None or biggest < known[0]:
                per_table[option.name] = (biggest, total, option.sharding_type)
        lines = [
            (
                f"BalancedPlanner: the tables do not fit in {tier.upper()} of the sharding group "
                f"({self.sharding_group_size} ranks x {format_bytes(capacity)} left per rank after the storage reservation)."
            )
        ]
        too_big = sorted(((n, v) for n, v in per_table.items() if v[0] > capacity), key=lambda kv: -kv[1][0])
        for name, (biggest, _, sharding_type) in too_big:
            lines.append(
                f"  table {name!r} needs at least {format_bytes(biggest)} on one rank (its smallest shard, {sharding_type}) "
                f"but a rank has {format_bytes(capacity)}"
            )
        needed = sum(v[1] for v in per_table.values())
        if not too_big:
            lines.append(
                f"  together the tables need about {format_bytes(needed)} but the group has {format_bytes(capacity * self.sharding_group_size)}"
            )
        lines.append(
            "  Fix: raise memory_per_rank, use a larger sharding group, allow row_wise/column_wise for the large tables, "
            "or shrink them (rows, dim)."
        )
        return "\n".join(lines)


def make_balanced_plan(
    module: nn.Module, sharders: list[ModuleSharder[nn.Module]], **planner_kwargs: Any
) -> tuple[ShardingPlan, BalancedPlanner]:
    """``make_sharding_plan``'s counterpart: ``BalancedPlanner(**planner_kwargs)`` on global rank 0, for every rank.

    Returns the plan and the planner (its ``last_result`` is set on rank 0 only).
    """
    planner = BalancedPlanner(**planner_kwargs)
    return plan_for_every_rank(planner, module, sharders), planner

"""The planning pipeline: profile -> stats -> reshape -> plan (rank 0, for every rank) -> report.

``TwoDRecStrategy`` runs it at setup and ``lightning-recsys plan`` runs it for a config, so the
command prints the report that training logs. It needs no Trainer: the caller hands in this
process's rank, a ``Broadcast`` (``lightning_recsys.planner.collective``) and, for profiling,
anything with ``train_dataloader()``. What rank 0 raises (a bad constraint, a profile that fails,
no plan that fits) is raised on every rank. No Lightning imports.

1. **Inputs** (``PlanningPipeline.prepare``, rank 0): the per-rank batch size (given, else
   profiled, else TorchRec's default of 512), the per-table statistics (profiled on
   ``profile_batches`` batches, else ``table_stats``, else assumed), and, with
   ``reshape_tables``, the reshape advice. Every rank gets them and applies the reshape.
2. **Plan** (``PlanningPipeline.plan``, rank 0): TorchRec's ``EmbeddingShardingPlanner`` or
   ``BalancedPlanner``, both told the same batch size, statistics, constraints and hash partitions;
   the plan is broadcast. Rank 0 measures it into a ``PlanReport`` before DMP changes the module.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn
from torchrec.distributed.planner.types import PlannerError, PlannerErrorType
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    EnumerableShardingSpec,
    ModuleSharder,
    ShardingPlan,
    ShardingPlanner,
    ShardingType,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, data_type_to_dtype

from lightning_recsys.parallel.sharding import apply_reshape
from lightning_recsys.parallel.topology import ParallelTopology
from lightning_recsys.planner.balanced import BalancedPlanner
from lightning_recsys.planner.balanced.planner import DEFAULT_COMPUTE_KERNELS
from lightning_recsys.planner.collective import Broadcast, no_broadcast, on_rank_zero
from lightning_recsys.planner.config import PLANNERS, PlannerName, PlanningConfig
from lightning_recsys.planner.constraints import check_hash_partitions, check_table_options, pooling_factor_defaults
from lightning_recsys.planner.report import PlanReport, build_plan_report
from lightning_recsys.planner.reshape import ReshapeAdvice, suggest_reshape
from lightning_recsys.planner.shard_cost import CommCosts, format_bytes
from lightning_recsys.planner.stats import TableStats, profile_datamodule, resolve_table_stats
from lightning_recsys.planner.tables import ModelTables, model_tables
from lightning_recsys.planner.torchrec_planner import DEFAULT_BATCH_SIZE, torchrec_planner

PLANNER_LABELS: dict[str, str] = {"torchrec": "TorchRec EmbeddingShardingPlanner", "balanced": "BalancedPlanner"}


class HasTrainLoader(Protocol):
    """A DataModule, or anything else that yields training batches (``RecBatch`` or KJTs)."""

    def train_dataloader(self) -> Iterable[Any]: ...


@dataclass(frozen=True)
class PlanningInputs:
    """What the planners are told: examples per rank per step, per-table stats (None: assumed), reshapes made,
    and the tables they plan (after the reshape; ``prepare`` sets them on every rank, None: read from the module)."""

    batch_size: int
    stats: dict[str, TableStats] | None
    reshape: tuple[ReshapeAdvice, ...] = ()
    stats_source: str = "given"  # "profiled": measured on profile_batches batches; "given": PlanningConfig(table_stats)
    tables: ModelTables | None = None


@dataclass(frozen=True)
class PlannedSharding:
    """A plan (group-local ranks; the same on every rank) and, on rank 0, its report."""

    plan: ShardingPlan
    report: PlanReport | None
    inputs: PlanningInputs


class PlanningPipeline:
    """Plans one sharding group of ``topology`` for ``compute_device``; see the module docstring.

    Args:
        config: the planner settings.
        sharders: the sharders DMP gets (their QComms codecs set the wire bytes).
        topology: the world layout; the plan is made for one sharding group of it.
        compute_device: ``"cpu"`` or ``"cuda"`` (a CUDA plan needs no GPU).
        rank: this process's global rank; rank 0 plans.
        broadcast: hands rank 0's object to every rank; every rank calls it (default: one process).
        memory_per_rank: HBM (CUDA) or DDR (CPU) bytes per rank; default TorchRec's.
        final_sharders: the sharders DMP gets for a plan (their QComms codecs know the plan's scale
            block, and any fallback it forces); the report counts their bytes. Default: ``sharders``.
    """

    def __init__(
        self,
        config: PlanningConfig,
        *,
        sharders: list[ModuleSharder[nn.Module]],
        topology: ParallelTopology,
        compute_device: str,
        rank: int = 0,
        broadcast: Broadcast = no_broadcast,
        memory_per_rank: int | None = None,
        final_sharders: Callable[[ShardingPlan], Sequence[ModuleSharder[nn.Module]]] | None = None,
    ) -> None:
        self.config = config
        self.sharders = sharders
        self.topology = topology
        self.compute_device = compute_device
        self.rank = rank
        self.broadcast = broadcast
        self.memory_per_rank = memory_per_rank
        self.comm_costs = CommCosts.from_sharders(sharders)
        self.final_sharders = final_sharders

    @property
    def _group(self) -> dict[str, Any]:
        topology = self.topology
        return {
            "sharding_group_size": topology.sharding_group_size,
            "group_ranks_per_node": topology.group_ranks_per_node,
            "compute_device": self.compute_device,
        }

    def run(
        self,
        module: nn.Module,
        datamodule: HasTrainLoader | None = None,
        *,
        setup_datamodule: bool = False,
        batch_size: int | None = None,
        tables: ModelTables | None = None,
    ) -> PlannedSharding:
        """``prepare`` then ``plan``: every rank calls it, and gets the same plan."""
        inputs = self.prepare(module, datamodule, setup_datamodule=setup_datamodule, batch_size=batch_size, tables=tables)
        return self.plan(module, inputs)

    def prepare(
        self,
        module: nn.Module,
        datamodule: HasTrainLoader | None = None,
        *,
        setup_datamodule: bool = False,
        batch_size: int | None = None,
        tables: ModelTables | None = None,
    ) -> PlanningInputs:
        """Profile and advise on rank 0, then reshape ``module`` on every rank; returns what planning is told.

        ``datamodule`` is profiled only with ``profile_batches > 0``; ``setup_datamodule`` first calls
        its ``setup("fit")`` (False where a Trainer already did). ``batch_size`` (examples per rank
        per step) overrides the profiled one. ``tables``: ``model_tables(module)`` if the caller has it.
        """
        tables = tables if tables is not None else model_tables(module)
        inputs: PlanningInputs = on_rank_zero(
            lambda: self._inputs(tables, datamodule, setup_datamodule, batch_size), rank=self.rank, broadcast=self.broadcast
        )
        if inputs.reshape:
            apply_reshape(module, inputs.reshape)  # every rank: the plan is for the reshaped tables
            tables = model_tables(module)  # the reshape replaced them: read the new ones once
        return dataclasses.replace(inputs, tables=tables)

    def plan(self, module: nn.Module, inputs: PlanningInputs, planner: PlannerName | None = None) -> PlannedSharding:
        """Plan on rank 0 (with ``planner``, default the config's) and broadcast; rank 0 also reports."""
        name = planner or self.config.planner
        if name not in PLANNERS:
            raise ValueError(f"planner={name!r} is not one of {list(PLANNERS)}.")
        reports: list[PlanReport] = []
        if inputs.tables is None:
            inputs = dataclasses.replace(inputs, tables=model_tables(module))

        def plan_and_report() -> ShardingPlan:
            assert inputs.tables is not None
            check_embedding_dims(list(inputs.tables), self.config)
            check_table_options(
                inputs.tables, self.sharders, self.compute_device, table_constraints=self.config.table_constraints,
                hash_partitions=self.config.hash_partitions,
                default_compute_kernels=DEFAULT_COMPUTE_KERNELS if name == "balanced" else None,
            )
            try:
                plan = self._planner(name, inputs).plan(module, self.sharders)
            except PlannerError as error:
                if name != "torchrec" or error.error_type != PlannerErrorType.INSUFFICIENT_STORAGE:
                    raise
                raise PlannerError(f"{error}\n{largest_tables(list(inputs.tables))}", error.error_type) from error
            if self.compute_device == "cpu":
                check_row_shards_have_rows(plan)
            # What the plan's codecs send: fp8/int8 scale blocks (or a bf16 fallback) are known only now.
            comm = CommCosts.from_sharders(self.final_sharders(plan)) if self.final_sharders is not None else self.comm_costs
            reports.append(self._report(plan, module, inputs, PLANNER_LABELS[name], comm))  # before DMP changes the module
            return plan

        plan = on_rank_zero(plan_and_report, rank=self.rank, broadcast=self.broadcast)
        return PlannedSharding(plan=plan, report=reports[0] if reports else None, inputs=inputs)

    # -- stages
    def _inputs(self, tables: ModelTables, datamodule: HasTrainLoader | None, setup: bool, batch_size: int | None) -> PlanningInputs:
        config = self.config
        stats = dict(config.table_stats) if config.table_stats else None
        source = "given"
        if config.profile_batches and datamodule is not None:
            try:
                profile = profile_datamodule(datamodule, config.profile_batches, setup=setup)
            except Exception as err:
                raise ValueError(
                    f"profiling {config.profile_batches} training batches of the DataModule failed ({type(err).__name__}: {err}); "
                    "fix the DataModule, or plan without profiling (profile_batches=0)."
                ) from err
            if stats:
                warnings.warn(
                    f"PlanningConfig(table_stats=...) for {sorted(stats)} is replaced by the profile of "
                    f"{config.profile_batches} training batches (profile_batches): give one of the two.",
                    stacklevel=2,
                )
            stats = profile.table_stats(tables.configs)  # the original tables, before any reshape
            source = "profiled"
            batch_size = batch_size or max(1, profile.examples // profile.batches)
        batch_size = batch_size or DEFAULT_BATCH_SIZE
        advice: list[ReshapeAdvice] = []
        if config.reshape_tables:
            # As the planner is told: a table that may only be data_parallel has no all-to-all to cut,
            # and one without statistics has its TableConstraints pooling factor.
            shardable = [t for t in tables if not _data_parallel_only(t.name, config)]
            names = {t.name for t in shardable}
            known = {name: s for name, s in (stats or {}).items() if name in names}
            advice = suggest_reshape(
                shardable,
                stats=resolve_table_stats(shardable, known, pooling_factor_defaults(config.table_constraints))[0],
                batch_size=batch_size,
                sharding_group_size=self.topology.sharding_group_size,
                comm_costs=self.comm_costs,
            )
        return PlanningInputs(batch_size=batch_size, stats=stats, reshape=tuple(advice), stats_source=source)

    def _planner(self, name: str, inputs: PlanningInputs) -> ShardingPlanner:
        config = self.config
        tables = inputs.tables
        assert tables is not None, "PlanningPipeline.prepare (or plan) sets the inputs' tables"
        hash_partitions = config.hash_partitions or {}
        check_hash_partitions(hash_partitions, list(tables), self.topology.sharding_group_size)
        told: Mapping[str, Any] = {
            **self._group,
            "batch_size": inputs.batch_size,
            "stats": inputs.stats,
            "constraints": config.table_constraints,
            "hash_partitions": hash_partitions,
            "memory_per_rank": self.memory_per_rank,
        }
        if name == "balanced":
            return BalancedPlanner(**told, comm_costs=self.comm_costs, tables=tables)
        return torchrec_planner(tables, **told)

    def _report(self, plan: ShardingPlan, module: nn.Module, inputs: PlanningInputs, label: str, comm: CommCosts) -> PlanReport:
        config = self.config
        return build_plan_report(
            plan,
            module,
            self.sharders,
            **self._group,
            batch_size=inputs.batch_size,
            stats=inputs.stats,
            table_constraints=config.table_constraints,
            hash_partitions=config.hash_partitions,
            comm_costs=comm,
            planner=label,
            reshape=inputs.reshape,
            stats_source=inputs.stats_source,
            tables=inputs.tables,
        )


def _data_parallel_only(table: str, config: PlanningConfig) -> bool:
    constraint = config.table_constraints.get(table)
    allowed = (constraint.sharding_types if constraint is not None and constraint.sharding_types else None) or config.sharding_types
    return allowed is not None and set(allowed) == {"data_parallel"}


def check_embedding_dims(tables: list[BaseEmbeddingConfig], config: PlanningConfig) -> None:
    """Refuse, before planning, tables whose dim FBGEMM's fused kernels cannot take (a multiple of 4).

    TorchRec asserts it only when it builds the kernels (``_assert_local_cols_divisible_by_4`` in
    ``torchrec/distributed/batched_embedding_kernel.py``), on CPU too, deep inside sharding.
    """
    bad = [f"{t.name!r} (dim {t.embedding_dim})" for t in tables if t.embedding_dim % 4 and not _data_parallel_only(t.name, config)]
    if bad:
        raise ValueError(
            f"embedding table(s) {', '.join(bad)}: embedding_dim must be a multiple of 4 for TorchRec's fused (FBGEMM) "
            "kernels, which every sharding type but data_parallel uses. Round the dim up to a multiple of 4, or "
            "constrain the table to data_parallel (TableConstraints(sharding_types=['data_parallel']))."
        )


_ROW_SPLIT = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


def check_row_shards_have_rows(plan: ShardingPlan) -> None:
    """Refuse a CPU plan that leaves some rank a row-wise embedding kernel of 0 rows.

    TorchRec gives every rank of a row-wise table a shard, of 0 rows when the table has fewer rows
    than the group has ranks; a rank whose row-wise tables of one module and kernel are all empty
    builds an FBGEMM table-batched embedding without rows, and FBGEMM's CPU path then raises
    "weights[0] must be a GPU or MTIA tensor" at the first lookup
    (``fbgemm_gpu/split_table_batched_embeddings_ops_training.py`` checks ``host_weights.numel() > 0``).
    """
    for module_path, module_plan in plan.plan.items():
        if not isinstance(module_plan, EmbeddingModuleShardingPlan):
            continue
        rows: dict[tuple[str, str], dict[int, int]] = {}  # (sharding type, kernel) -> rank -> rows there
        tables: dict[tuple[str, str], list[str]] = {}
        for table, sharding in module_plan.items():
            spec = sharding.sharding_spec
            if sharding.sharding_type not in _ROW_SPLIT or not isinstance(spec, EnumerableShardingSpec):
                continue
            kernel = (sharding.sharding_type, sharding.compute_kernel)
            per_rank = rows.setdefault(kernel, {})
            for shard in spec.shards:
                assert shard.placement is not None
                per_rank[shard.placement.rank()] = per_rank.get(shard.placement.rank(), 0) + shard.shard_sizes[0]
            tables.setdefault(kernel, []).append(f"{table!r} ({sum(s.shard_sizes[0] for s in spec.shards)} rows)")
        for (sharding_type, kernel), per_rank in rows.items():
            empty = sorted(rank for rank, count in per_rank.items() if count == 0)
            if empty:
                raise ValueError(
                    f"{module_path or 'the model'}: the {sharding_type} tables {', '.join(tables[(sharding_type, kernel)])} "
                    f"(compute kernel {kernel}) leave rank(s) {empty} of each sharding group of {len(per_rank)} ranks with "
                    "0 rows, and FBGEMM's CPU kernel cannot look up an empty table batch. Allow another sharding type "
                    "for these tables (TableConstraints(sharding_types=['table_wise', 'data_parallel'])), give them more rows "
                    "(TorchRec cuts a row-wise table into blocks of ceil(rows / ranks), so the last ranks may get none), "
                    "or use a smaller sharding_group_size."
                )


def largest_tables(tables: list[BaseEmbeddingConfig], shown: int = 5) -> str:
    """What TorchRec's out-of-storage ``PlannerError`` leaves out: which tables are large, and the ways out."""
    by_size = sorted(tables, key=lambda t: -t.num_embeddings * t.embedding_dim * data_type_to_dtype(t.data_type).itemsize)
    listed = ", ".join(
        f"{t.name!r} {t.num_embeddings} x {t.embedding_dim} "
        f"({format_bytes(t.num_embeddings * t.embedding_dim * data_type_to_dtype(t.data_type).itemsize)})"
        for t in by_size[:shown]
    )
    more = f" and {len(by_size) - shown} more" if len(by_size) > shown else ""
    return (
        f"The largest tables (rows x dim, weights without optimizer state): {listed}{more}. Fix: more ranks per sharding "
        "group, row_wise/column_wise allowed for the large tables, smaller tables, or PlanningConfig(planner='balanced'), "
        "whose error names each table that does not fit and the memory it needs."
    )

"""Plan reports: per rank, what a sharding plan puts there and what it costs per step.

``build_plan_report`` measures any ``ShardingPlan`` (ours or TorchRec's default planner's) for a
module: it rebuilds TorchRec's sharding options from the plan's shards, asks TorchRec's
estimators for their storage and perf (step time), and adds the load model's lookups and comm
bytes (see ``shard_cost``). The report renders as a fixed-width table (``to_table``) and as JSON
(``to_json``). No Lightning imports.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.planner.enumerators import (
    EmbeddingEnumerator,
    get_partition_by_type,
)
from torchrec.distributed.planner.types import Shard, ShardingOption
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardingPlan,
    ShardingType,
)

from lightning_recsys.planner.constraints import TableConstraints, pooling_factor_defaults
from lightning_recsys.planner.reshape import ReshapeAdvice
from lightning_recsys.planner.shard_cost import CommCosts, Imbalance, format_bytes, shard_cost, storage_tier
from lightning_recsys.planner.stats import LoadProfile, TableStats, resolve_table_stats
from lightning_recsys.planner.tables import ModelTables, model_tables
from lightning_recsys.planner.torchrec_planner import DEFAULT_BATCH_SIZE, torchrec_topology

REPORT_METRICS: tuple[str, ...] = ("storage_bytes", "lookups", "a2a_bytes", "step_time_ms")
_SHORT_TYPES = {
    ShardingType.DATA_PARALLEL.value: "dp",
    ShardingType.TABLE_WISE.value: "tw",
    ShardingType.ROW_WISE.value: "rw",
    ShardingType.COLUMN_WISE.value: "cw",
    ShardingType.TABLE_ROW_WISE.value: "twrw",
    ShardingType.TABLE_COLUMN_WISE.value: "twcw",
    ShardingType.GRID_SHARD.value: "grid",
}


@dataclass(frozen=True)
class ShardReport:
    """One shard: where it is, its slice of the table and its per-step cost on its rank."""

    table: str
    module: str
    sharding_type: str
    compute_kernel: str
    rank: int
    index: int
    num_shards: int
    row_offset: int
    rows: int
    column_offset: int
    columns: int
    storage_bytes: float
    lookups: float
    a2a_bytes: float
    allreduce_bytes: float
    step_time_ms: float

    @property
    def label(self) -> str:
        short = _SHORT_TYPES.get(self.sharding_type, self.sharding_type)
        return f"{self.table}:{short}" if self.num_shards == 1 or short == "dp" else f"{self.table}:{short}{self.index + 1}/{self.num_shards}"


@dataclass(frozen=True)
class RankReport:
    """Everything one rank of the sharding group holds, and its per-step totals."""

    rank: int
    shards: tuple[str, ...]
    storage_bytes: float
    lookups: float
    a2a_bytes: float
    allreduce_bytes: float
    step_time_ms: float


@dataclass(frozen=True)
class TableReport:
    """One table: its shape, how it is sharded, and the traffic the plan assumed for it."""

    name: str
    rows: int
    dim: int
    sharding_type: str
    num_shards: int
    pooling_factor: float
    lookups_per_example: float
    hot_row_share: float | None
    stats_source: str
    hash_partitions: int | None
    sampled_lookups: int | None = None  # a profile's lookups and the distinct rows they hit
    sampled_distinct_rows: int | None = None


@dataclass(frozen=True)
class PlanReport:
    """A sharding plan measured per rank: storage, lookups, comm bytes and TorchRec's step-time estimate.

    ``imbalance[m]`` is max / mean over ranks of ``m`` in ``REPORT_METRICS``; ``step_time_ms`` is
    the largest per-rank sum of TorchRec's per-shard perf estimates (its NoopPerfModel rating).
    """

    planner: str
    sharding_group_size: int
    group_ranks_per_node: int
    compute_device: str
    batch_size: int
    comm: str
    tables: tuple[TableReport, ...]
    shards: tuple[ShardReport, ...]
    ranks: tuple[RankReport, ...]
    imbalance: dict[str, Imbalance]
    step_time_ms: float
    reshape: tuple[ReshapeAdvice, ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-serializable dict (bytes in bytes, times in ms)."""
        return {
            "planner": self.planner,
            "sharding_group_size": self.sharding_group_size,
            "group_ranks_per_node": self.group_ranks_per_node,
            "compute_device": self.compute_device,
            "batch_size_per_rank": self.batch_size,
            "comm": self.comm,
            "step_time_ms": self.step_time_ms,
            "imbalance": {m: {"max": i.max, "mean": i.mean, "max_over_mean": i.ratio} for m, i in self.imbalance.items()},
            "ranks": [
                {
                    "rank": r.rank,
                    "shards": list(r.shards),
                    "storage_bytes": r.storage_bytes,
                    "lookups_per_step": r.lookups,
                    "a2a_bytes_per_step": r.a2a_bytes,
                    "allreduce_bytes_per_step": r.allreduce_bytes,
                    "step_time_ms": r.step_time_ms,
                }
                for r in self.ranks
            ],
            "tables": [t.__dict__ for t in self.tables],
            "shards": [s.__dict__ for s in self.shards],
            "reshape": [a.to_json() for a in self.reshape],
        }

    def to_table(self) -> str:
        """A fixed-width text rendering for logs and the ``plan`` CLI."""
        lines = [
            (
                f"Sharding plan ({self.planner}): {self.sharding_group_size} ranks per sharding group, "
                f"{self.group_ranks_per_node} per node, {self.compute_device}, batch {self.batch_size} per rank"
            ),
            f"Comm: {self.comm}",
            "",
        ]
        header = ("rank", "storage", "lookups/step", "a2a bytes/step", "est. ms", "shards")
        body = [
            (str(r.rank), format_bytes(r.storage_bytes), _fmt_count(r.lookups), format_bytes(r.a2a_bytes), f"{r.step_time_ms:.3f}", " ".join(r.shards))
            for r in self.ranks
        ]
        imb = self.imbalance
        body.append(
            (
                "max/mean",
                f"{imb['storage_bytes'].ratio:.3f}",
                f"{imb['lookups'].ratio:.3f}",
                f"{imb['a2a_bytes'].ratio:.3f}",
                f"{imb['step_time_ms'].ratio:.3f}",
                "",
            )
        )
        lines += _render(header, body)
        allreduce = max((r.allreduce_bytes for r in self.ranks), default=0.0)
        lines.append("")
        lines.append(
            f"Estimated step time (TorchRec perf, slowest rank): {self.step_time_ms:.3f} ms"
            + (f"; data-parallel gradient all-reduce: {format_bytes(allreduce)}/step per rank" if allreduce else "")
        )
        lines.append("")
        t_header = ("table", "rows x dim", "sharding", "shards", "ids/example", "hot 1% share", "stats")
        t_body = [
            (
                t.name,
                f"{t.rows} x {t.dim}",
                t.sharding_type + (f" ({t.hash_partitions} hash partitions)" if t.hash_partitions else ""),
                str(t.num_shards),
                f"{t.lookups_per_example:.2f}",
                "-" if t.hot_row_share is None else f"{t.hot_row_share:.3f}",
                t.stats_source,
            )
            for t in self.tables
        ]
        lines += _render(t_header, t_body)
        if self.reshape:
            lines.append("")
            lines.append("Bandwidth-aware reshape (dim/2, rows*2): a2a bytes per step, table-wise, before -> after")
            r_header = ("table", "before", "after", "bytes before", "bytes after", "saving")
            r_body = [
                (
                    a.table,
                    f"{a.rows} x {a.dim}",
                    f"{a.new_rows} x {a.new_dim}",
                    format_bytes(a.bytes_before),
                    format_bytes(a.bytes_after),
                    f"{100 * a.saving:.1f}%",
                )
                for a in self.reshape
            ]
            lines += _render(r_header, r_body)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_table()


def _render(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(header[i]), *(len(row[i]) for row in body)) if body else len(header[i]) for i in range(len(header))]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in body]
    return out


def _fmt_count(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return f"{value:.1f}"


def build_plan_report(
    plan: ShardingPlan,
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    *,
    sharding_group_size: int,
    group_ranks_per_node: int | None = None,
    compute_device: str = "cpu",
    batch_size: int = DEFAULT_BATCH_SIZE,
    stats: Mapping[str, TableStats] | LoadProfile | None = None,
    table_constraints: Mapping[str, TableConstraints] | None = None,
    hash_partitions: Mapping[str, int] | None = None,
    comm_costs: CommCosts | None = None,
    planner: str = "",
    reshape: Sequence[ReshapeAdvice] = (),
    stats_source: str = "observed",
    tables: ModelTables | None = None,
) -> PlanReport:
    """Measure ``plan`` (group-local ranks) for ``module``; works for plans from any TorchRec planner.

    ``stats_source``: what the report calls the tables' ``stats`` (``"profiled"``, ``"given"``); tables
    without stats are ``"assumed"``. ``tables``: the module's, when the caller has read them already.
    """
    configs = (tables if tables is not None else model_tables(module)).configs
    resolved, assumed = resolve_table_stats(configs, stats, pooling_factor_defaults(table_constraints))
    topology = torchrec_topology(sharding_group_size, group_ranks_per_node, compute_device)
    comm = comm_costs or CommCosts.from_sharders(sharders)
    tier = storage_tier(compute_device)
    # Only the traffic constrains the estimates: every sharding type must be enumerable to match the plan.
    constraints = {
        t.name: ParameterConstraints(pooling_factors=[resolved[t.name].pooling_factor] * resolved[t.name].features) for t in configs
    }
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch_size, constraints=constraints)
    templates: dict[tuple[str, str], list[ShardingOption]] = defaultdict(list)
    for option in enumerator.enumerate(module, sharders):
        templates[(option.path, option.name)].append(option)

    options: list[ShardingOption] = []
    for module_fqn, module_plan in plan.plan.items():
        if not isinstance(module_plan, EmbeddingModuleShardingPlan):
            continue
        for name, sharding in module_plan.items():
            candidates = templates.get((module_fqn, name))
            if not candidates:
                raise ValueError(f"the plan shards {module_fqn}.{name}, which the module's sharders do not shard.")
            template = next(
                (o for o in candidates if (o.sharding_type, o.compute_kernel) == (sharding.sharding_type, sharding.compute_kernel)),
                candidates[0],
            )
            option = copy.deepcopy(template)
            option.sharding_type = sharding.sharding_type
            option.compute_kernel = sharding.compute_kernel
            option.partition_by = get_partition_by_type(sharding.sharding_type)
            option.shards = _shards_of(sharding, option, sharding_group_size)
            options.append(option)
    enumerator.populate_estimates(options)

    shard_reports: list[ShardReport] = []
    table_reports: list[TableReport] = []
    for option in options:
        table_stats = resolved[option.name]
        for i, shard in enumerate(option.shards):
            cost = shard_cost(option, i, stats=table_stats, batch_size=batch_size, group_size=sharding_group_size, comm=comm, tier=tier)
            assert shard.rank is not None
            shard_reports.append(
                ShardReport(
                    table=option.name,
                    module=option.path,
                    sharding_type=option.sharding_type,
                    compute_kernel=option.compute_kernel,
                    rank=shard.rank,
                    index=i,
                    num_shards=len(option.shards),
                    row_offset=int(shard.offset[0]),
                    rows=int(shard.size[0]),
                    column_offset=int(shard.offset[1]),
                    columns=int(shard.size[1]),
                    storage_bytes=cost.storage,
                    lookups=cost.lookups,
                    a2a_bytes=cost.a2a_bytes,
                    allreduce_bytes=cost.allreduce_bytes,
                    step_time_ms=shard.perf.total if shard.perf is not None else 0.0,
                )
            )
        # The option's own tensor, not a lookup by name: two embedding modules may each have a table of that name.
        rows, dim = (int(size) for size in option.tensor.shape)
        table_reports.append(
            TableReport(
                name=option.name,
                rows=rows,
                dim=dim,
                sharding_type=option.sharding_type,
                num_shards=len(option.shards),
                pooling_factor=table_stats.pooling_factor,
                lookups_per_example=table_stats.lookups_per_example,
                hot_row_share=table_stats.hot_row_share,
                stats_source="assumed" if option.name in assumed else stats_source,
                hash_partitions=(hash_partitions or {}).get(option.name),
                sampled_lookups=table_stats.sampled_lookups,
                sampled_distinct_rows=table_stats.sampled_distinct_rows,
            )
        )

    ranks: list[RankReport] = []
    for rank in range(sharding_group_size):
        mine = [s for s in shard_reports if s.rank == rank]
        ranks.append(
            RankReport(
                rank=rank,
                shards=tuple(s.label for s in mine),
                storage_bytes=sum(s.storage_bytes for s in mine),
                lookups=sum(s.lookups for s in mine),
                a2a_bytes=sum(s.a2a_bytes for s in mine),
                allreduce_bytes=sum(s.allreduce_bytes for s in mine),
                step_time_ms=sum(s.step_time_ms for s in mine),
            )
        )
    imbalance = {
        "storage_bytes": Imbalance.of([r.storage_bytes for r in ranks]),
        "lookups": Imbalance.of([r.lookups for r in ranks]),
        "a2a_bytes": Imbalance.of([r.a2a_bytes for r in ranks]),
        "step_time_ms": Imbalance.of([r.step_time_ms for r in ranks]),
    }
    return PlanReport(
        planner=planner,
        sharding_group_size=sharding_group_size,
        group_ranks_per_node=topology.local_world_size,
        compute_device=compute_device,
        batch_size=batch_size,
        comm=comm.describe(),
        tables=tuple(table_reports),
        shards=tuple(shard_reports),
        ranks=tuple(ranks),
        imbalance=imbalance,
        step_time_ms=imbalance["step_time_ms"].max,
        reshape=tuple(reshape),
    )


def _shards_of(sharding: Any, option: ShardingOption, group_size: int) -> list[Shard]:
    rows, dim = int(option.tensor.shape[0]), int(option.tensor.shape[1])
    spec = sharding.sharding_spec
    ranks = list(sharding.ranks or [])
    if spec is None:  # data-parallel: a full replica on every rank of the group
        return [Shard(size=[rows, dim], offset=[0, 0], rank=r) for r in (ranks or range(group_size))]
    shards = []
    for i, meta in enumerate(spec.shards):
        # ParameterSharding.ranks are group-local; placements may already name global ranks.
        rank = ranks[i] if i < len(ranks) else meta.placement.rank()
        shards.append(Shard(size=list(meta.shard_sizes), offset=list(meta.shard_offsets), rank=int(rank)))
    return shards

"""BalancedPlanner: a load-aware TorchRec sharding planner balancing storage, lookups, comm bytes and step time.

It is TorchRec's ``EmbeddingShardingPlanner`` with our components in its extension points:

* ``BalancedEnumerator`` (an ``EmbeddingEnumerator``): TorchRec's sharding options, with the
  pooling factors of the observed traffic in the constraints (so TorchRec's own perf and storage
  estimates see the real load), plus column-wise options with more column splits than TorchRec
  enumerates (it offers one split per table).
* ``BalancedProposer``: steepest descents over the tables' sharding options, from several
  starts (from "cheapest option per table" to "no shard above a quarter of a rank's load"),
  re-sharding the tables that load the bottleneck rank of each metric, rated by the planner loop.
* ``BalancedPartitioner``: places shards to minimize the largest per-rank load of each metric
  (greedy largest-first, or warm-started from the best plan so far, then moves and swaps off the
  bottleneck ranks), within the memory left after the storage reservation; row-wise and
  data-parallel shards keep TorchRec's fixed layout.
* ``BalancedPerfModel``: rates a placed plan by the ``BalanceObjective`` (``load_model``): per
  metric (storage, lookups, comm bytes, TorchRec's step-time estimate) the largest per-rank load
  in units of ``ref_m``, plus a penalty for imbalance beyond a tolerance. ``ref_m`` is the per-rank share of the cheapest
  sharding of every table: a fixed yardstick, so plans that add traffic pay for it.

Hash partitions: a table whose ids are hashed into ``P`` partitions of ``rows / P`` contiguous rows
is sharded row-wise with ``P / G`` whole partitions per rank (``G``: the sharding group size).

2D: the planner plans one sharding group (``sharding_group_size`` ranks, ``local_world_size`` of
them per node); every replica group uses the same plan. No Lightning imports.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.storage_reservations import (
    FixedPercentageStorageReservation,
)
from torchrec.distributed.planner.types import (
    Enumerator,
    KernelConfig,
    PartitionByType,
    Partitioner,
    PerfModel,
    PlannerError,
    PlannerErrorType,
    Proposer,
    Shard,
    ShardingOption,
    Storage,
    StorageReservation,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardingPlan,
    ShardingPlanner,
    ShardingType,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from lightning_recsys.planner.load_model import (
    BalanceObjective,
    CommCosts,
    ShardCost,
    shard_cost,
    storage_tier,
)
from lightning_recsys.planner.plan import TableConstraints
from lightning_recsys.planner.stats import (
    LoadProfile,
    TableStats,
    profile_datamodule,
    resolve_table_stats,
)

_NUM_METRICS = 4
_EPS = 1e-12
_MOVABLE = (PartitionByType.DEVICE.value,)
DEFAULT_COMPUTE_KERNELS: tuple[str, ...] = ("fused", "dense")  # dense: TorchRec's data-parallel kernel
_COLUMN_TYPES = (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value)


# ----------------------------------------------------------------------------------- helpers
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


def embedding_tables(module: nn.Module) -> list[BaseEmbeddingConfig]:
    """Every table config of the module's EmbeddingBagCollections and EmbeddingCollections."""
    tables: list[BaseEmbeddingConfig] = []
    for sub in module.modules():
        if isinstance(sub, EmbeddingBagCollection):
            tables += list(sub.embedding_bag_configs())
        elif isinstance(sub, EmbeddingCollection):
            tables += list(sub.embedding_configs())
    return tables


def make_topology(
    sharding_group_size: int,
    local_world_size: int | None,
    compute_device: str,
    memory_per_rank: int | None = None,
) -> Topology:
    """A TorchRec ``Topology`` for one sharding group (no process group needed)."""
    if sharding_group_size < 1:
        raise ValueError(f"sharding_group_size={sharding_group_size} must be >= 1.")
    local = min(local_world_size or sharding_group_size, sharding_group_size)
    if sharding_group_size % local:
        raise ValueError(
            f"local_world_size={local_world_size} must divide sharding_group_size={sharding_group_size} "
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


def check_hash_partitions(
    hash_partitions: Mapping[str, int], tables: Sequence[BaseEmbeddingConfig], sharding_group_size: int
) -> None:
    """Raise ``ValueError`` unless every hashed table splits into whole, equal partition counts per rank."""
    rows_of = {t.name: t.num_embeddings for t in tables}
    for name, partitions in hash_partitions.items():
        if name not in rows_of:
            raise ValueError(f"hash_partitions names table {name!r}, which the model does not have; its tables are {sorted(rows_of)}.")
        rows = rows_of[name]
        if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
            raise ValueError(f"hash_partitions[{name!r}]={partitions!r} must be an integer >= 1.")
        if rows % partitions:
            raise ValueError(
                f"hash_partitions[{name!r}]={partitions}: table {name!r} has {rows} rows, which do not split into "
                f"{partitions} equal partitions; use a partition count that divides {rows}, e.g. "
                f"{_suggest_partitions(rows, sharding_group_size, partitions)}."
            )
        if partitions % sharding_group_size:
            raise ValueError(
                f"hash_partitions[{name!r}]={partitions} is not divisible by the sharding group size "
                f"{sharding_group_size}, so ranks would hold unequal numbers of partitions (and unequal load); "
                f"use a multiple of {sharding_group_size} that divides the table's {rows} rows, e.g. "
                f"{_suggest_partitions(rows, sharding_group_size, partitions)}."
            )


def _suggest_partitions(rows: int, group: int, wanted: int) -> str:
    """Partition counts near ``wanted`` that are multiples of ``group`` and divide ``rows``."""
    candidates = [p for p in range(group, min(rows, 64 * max(wanted, group)) + 1, group) if rows % p == 0]
    if not candidates:
        return f"none exists for {rows} rows: resize the table to a multiple of {group} rows"
    nearest = sorted(candidates, key=lambda p: (abs(p - wanted), p))[:2]
    return " or ".join(str(p) for p in sorted(nearest))


def torchrec_constraints(
    tables: Sequence[BaseEmbeddingConfig],
    *,
    stats: Mapping[str, TableStats],
    table_constraints: Mapping[str, TableConstraints] | None = None,
    hash_partitions: Mapping[str, int] | None = None,
    compute_kernels: Sequence[str] | None = None,
) -> dict[str, ParameterConstraints]:
    """TorchRec ``ParameterConstraints`` for every table: ours, the observed pooling factors, hash partitions.

    Give the same constraints to TorchRec's default planner to compare planners on equal information.
    """
    names = {t.name for t in tables}
    unknown = sorted(set(table_constraints or {}) - names)
    if unknown:
        raise ValueError(
            f"table_constraints names tables that the model does not have: {unknown}; the model's tables are {sorted(names)}."
        )
    constraints: dict[str, ParameterConstraints] = {}
    for table in tables:
        given = (table_constraints or {}).get(table.name)
        pc = given.to_torchrec() if given is not None else ParameterConstraints()
        table_stats = stats[table.name]
        pc.pooling_factors = [float(table_stats.pooling_factor)] * table_stats.features
        if compute_kernels is not None and (given is None or given.compute_kernels is None):
            pc.compute_kernels = list(compute_kernels)
        if table.name in (hash_partitions or {}):
            if pc.sharding_types is not None and ShardingType.ROW_WISE.value not in pc.sharding_types:
                raise ValueError(
                    f"table_constraints[{table.name!r}].sharding_types={pc.sharding_types} excludes 'row_wise', but "
                    f"hash_partitions[{table.name!r}] needs row-wise sharding on partition boundaries; allow 'row_wise' "
                    "or drop the table from hash_partitions."
                )
            pc.sharding_types = [ShardingType.ROW_WISE.value]
        constraints[table.name] = pc
    return constraints


# ----------------------------------------------------------------------------------- shared context
@dataclass
class BalanceContext:
    """What the enumerator, proposer, partitioner and perf model share during one ``plan()`` call."""

    stats: dict[str, TableStats]
    batch_size: int
    group_size: int
    comm: CommCosts
    balance: BalanceObjective
    tier: str
    intra_group_size: int
    refs: tuple[float, ...] = (1.0,) * _NUM_METRICS
    # (id of a search-space option, shard index) -> rank in the current best placement
    warm_start: dict[tuple[int, int], int] = field(default_factory=dict)
    _costs: dict[tuple[Any, ...], tuple[ShardCost, ...]] = field(default_factory=dict)

    def costs(self, option: ShardingOption) -> tuple[ShardCost, ...]:
        key = (option.fqn, option.sharding_type, option.compute_kernel, tuple((tuple(s.size), tuple(s.offset)) for s in option.shards))
        if key not in self._costs:
            stats = self.stats[option.name]
            self._costs[key] = tuple(
                shard_cost(option, i, stats=stats, batch_size=self.batch_size, group_size=self.group_size, comm=self.comm, tier=self.tier)
                for i in range(len(option.shards))
            )
        return self._costs[key]

    def normalized(self, option: ShardingOption) -> list[tuple[float, ...]]:
        """Each shard's cost as fractions of an ideal rank's load (``ref``) per metric."""
        r = self.refs
        return [tuple(v / ref for v, ref in zip(c.vector(), r)) for c in self.costs(option)]

    def total_cost(self, option: ShardingOption) -> float:
        w = self.balance.weights()
        return sum(w[m] * u[m] for u in self.normalized(option) for m in range(_NUM_METRICS))

    def largest_piece(self, option: ShardingOption, metric: int | None = None) -> float:
        """The largest shard of the option on ``metric`` (or on its worst weighted metric)."""
        w = self.balance.weights()
        pieces = self.normalized(option)
        if metric is not None:
            return max(u[metric] for u in pieces)
        return max(max(u[m] for m in range(_NUM_METRICS) if w[m] > 0) for u in pieces)

    def set_reference(self, search_space: Sequence[ShardingOption]) -> None:
        """``ref_m``: the per-rank share of the sum, over tables, of each table's cheapest option on ``m``."""
        cheapest: dict[str, list[float]] = {}
        for option in search_space:
            totals = [sum(c.vector()[m] for c in self.costs(option)) for m in range(_NUM_METRICS)]
            best = cheapest.setdefault(option.fqn, totals)
            cheapest[option.fqn] = [min(a, b) for a, b in zip(best, totals)]
        refs = [sum(t[m] for t in cheapest.values()) / self.group_size for m in range(_NUM_METRICS)]
        self.refs = tuple(r if r > 0 else 1.0 for r in refs)  # type: ignore[assignment]

    def rank_loads(self, plan: Sequence[ShardingOption]) -> list[list[float]]:
        loads = [[0.0] * _NUM_METRICS for _ in range(self.group_size)]
        for option in plan:
            for shard, u in zip(option.shards, self.normalized(option)):
                if shard.rank is None:
                    raise PlannerError(f"shard of {option.fqn} has no rank", PlannerErrorType.INVALID_RANK_ASSIGNMENT)
                for m in range(_NUM_METRICS):
                    loads[shard.rank][m] += u[m]
        return loads

    def objective(self, loads: Sequence[Sequence[float]]) -> float:
        ranks = len(loads)
        return sum(
            self.balance.metric_cost(m, max(row[m] for row in loads), sum(row[m] for row in loads) / ranks)
            for m in range(_NUM_METRICS)
        )


# ----------------------------------------------------------------------------------- enumerator
class BalancedEnumerator(EmbeddingEnumerator):
    """TorchRec's enumerator plus column-wise options with every even split TorchRec would accept.

    TorchRec enumerates one column-wise split per table (its widths are multiples of 4 that
    divide the dim, at least ``min_partition``, default 128). This adds the other such widths of
    at least ``min_column_width`` columns, up to ``max_column_shards`` shards, so the planner can
    cut a table just as finely as balance needs.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        constraints: dict[str, ParameterConstraints] | None = None,
        *,
        min_column_width: int = 4,
        max_column_shards: int | None = None,
    ) -> None:
        super().__init__(topology=topology, batch_size=batch_size, constraints=constraints)
        if min_column_width < 4 or min_column_width % 4:
            raise ValueError(f"min_column_width={min_column_width} must be a multiple of 4 (FBGEMM's alignment), >= 4.")
        self._min_column_width = min_column_width
        self._max_column_shards = max_column_shards or topology.world_size
        self.last_search_space: list[ShardingOption] = []

    def enumerate(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> list[ShardingOption]:
        options = super().enumerate(module, sharders)
        extra: list[ShardingOption] = []
        for option in options:
            if option.sharding_type != ShardingType.COLUMN_WISE.value:
                continue
            rows, dim = int(option.tensor.shape[0]), int(option.tensor.shape[1])
            floor = (self._constraints or {}).get(option.name)
            lowest = max(self._min_column_width, (floor.min_partition or 0) if floor else 0)
            lowest = -(-lowest // 4) * 4  # FBGEMM needs widths that are multiples of 4
            present = {len(option.shards)}
            for width in range(lowest, dim + 1, 4):
                shards = dim // width
                if dim % width or shards in present or shards > self._max_column_shards:
                    continue
                present.add(shards)
                variant = copy.deepcopy(option)
                variant.shards = [Shard(size=[rows, width], offset=[0, i * width]) for i in range(shards)]
                extra.append(variant)
        if extra:
            self.populate_estimates(extra)
        self.last_search_space = options + extra
        return self.last_search_space


# ----------------------------------------------------------------------------------- perf model
class BalancedPerfModel(PerfModel):
    """Rates a placed plan by the ``BalanceObjective`` of its per-rank loads (lower is better)."""

    def __init__(self, context: BalanceContext) -> None:
        self._ctx = context

    def rate(self, plan: list[ShardingOption]) -> float:
        return self._ctx.objective(self._ctx.rank_loads(plan))


# ----------------------------------------------------------------------------------- partitioner
@dataclass
class _Piece:
    option: ShardingOption
    index: int
    vector: tuple[float, ...]
    storage: Storage
    table: str = ""

    def __post_init__(self) -> None:
        self.table = self.option.fqn


class BalancedPartitioner(Partitioner):
    """Places shards so the largest per-rank load of each metric is as small as the shards allow.

    Row-wise and data-parallel shards go to ranks ``0..G-1`` in order (TorchRec's layout for them);
    table-row-wise shards to one node, in order. Table-, column- and table-column-wise shards are
    placed largest first on the rank that stays least loaded, never two shards of one table on a
    rank while another rank is free of it, then moved or swapped off the bottleneck ranks while
    that lowers the objective. Raises TorchRec's ``PlannerError`` naming the table when a shard
    fits on no rank.
    """

    def __init__(self, context: BalanceContext, max_moves: int = 500) -> None:
        self._ctx = context
        self._max_moves = max_moves

    def partition(self, proposal: list[ShardingOption], storage_constraint: Topology) -> list[ShardingOption]:
        ctx = self._ctx
        ranks = storage_constraint.world_size
        free = [copy.deepcopy(d.storage) for d in storage_constraint.devices]
        loads = [[0.0] * _NUM_METRICS for _ in range(ranks)]
        holders: list[Counter[str]] = [Counter() for _ in range(ranks)]
        host = max(1, min(ctx.intra_group_size, ranks))
        hosts = [list(range(h * host, (h + 1) * host)) for h in range(ranks // host)]

        def place(piece: _Piece, rank: int) -> None:
            self._take(piece, rank, free, loads, holders)

        def pieces_of(option: ShardingOption) -> list[_Piece]:
            return [
                _Piece(option, i, u, _storage(shard))
                for i, (shard, u) in enumerate(zip(option.shards, ctx.normalized(option)))
            ]

        movable: list[_Piece] = []
        host_bound: list[ShardingOption] = []
        for option in proposal:
            kind = option.partition_by
            if kind == PartitionByType.UNIFORM.value:
                if option.num_shards != ranks:
                    raise PlannerError(
                        f"{option.fqn}: a {option.sharding_type} option has {option.num_shards} shards for {ranks} ranks",
                        PlannerErrorType.PARTITION,
                    )
                for rank, piece in enumerate(pieces_of(option)):
                    self._require_fit(piece, [rank], free)
                    place(piece, rank)
            elif kind == PartitionByType.HOST.value:
                host_bound.append(option)
            elif kind in _MOVABLE:
                movable.extend(pieces_of(option))
            else:
                raise PlannerError(
                    f"{option.fqn}: BalancedPlanner does not place {option.sharding_type} ({kind}) shards; "
                    "remove it from the table's sharding_types",
                    PlannerErrorType.PARTITION,
                )

        for option in host_bound:  # table-row/column-wise: all shards on one node, the least loaded one
            order = sorted(range(len(hosts)), key=lambda h: (ctx.objective([loads[r] for r in hosts[h]]), h))
            pieces = pieces_of(option)
            target = next((hosts[h] for h in order if self._host_fits(pieces, hosts[h], free, option)), None)
            if target is None:
                needed = sum(_bytes(p.storage, ctx.tier) for p in pieces)
                room = max(sum(_bytes(free[r], ctx.tier) for r in h) for h in hosts)
                raise PlannerError(
                    f"table {option.name!r} ({option.fqn}): its {option.sharding_type} shards need {_fmt_bytes(needed)} of "
                    f"{ctx.tier.upper()} on one node, but the most any node has left is {_fmt_bytes(room)}",
                    PlannerErrorType.PARTITION,
                )
            if option.sharding_type == ShardingType.TABLE_ROW_WISE.value:
                for piece, rank in zip(pieces, target):
                    place(piece, rank)
            else:
                for piece in pieces:
                    place(piece, self._best_rank(piece, target, free, loads, holders))

        # Two placements of the movable shards, keeping the better: from scratch, and warm-started
        # from the current best plan (tables whose option is unchanged keep their ranks). The warm
        # one is usually better and converges faster; from scratch escapes its local optima.
        base = (copy.deepcopy(free), copy.deepcopy(loads), copy.deepcopy(holders))
        best_ranks: list[int] | None = None
        best_value = math.inf
        for warm in ([False, True] if ctx.warm_start else [False]):
            free, loads, holders = copy.deepcopy(base[0]), copy.deepcopy(base[1]), copy.deepcopy(base[2])
            self._place_movable(movable, free, loads, holders, warm)
            self._improve(movable, free, loads, holders)
            value = ctx.objective(loads)
            if value < best_value - _EPS:
                best_value, best_ranks = value, [_rank(p) for p in movable]
        for piece, rank in zip(movable, best_ranks or []):
            piece.option.shards[piece.index].rank = rank
        return proposal

    def _place_movable(
        self, movable: list[_Piece], free: list[Storage], loads: list[list[float]], holders: list[Counter[str]], warm: bool
    ) -> None:
        ctx = self._ctx
        ranks = len(loads)
        fresh: list[_Piece] = []
        for piece in movable:
            rank = ctx.warm_start.get((id(piece.option), piece.index)) if warm else None
            if rank is not None and rank < ranks and piece.storage.fits_in(free[rank]) and not holders[rank][piece.table]:
                self._take(piece, rank, free, loads, holders)
            else:
                fresh.append(piece)
        weights = ctx.balance.weights()
        fresh.sort(key=lambda p: (-max(weights[m] * p.vector[m] for m in range(_NUM_METRICS)), p.table, p.index))
        for piece in fresh:
            self._take(piece, self._best_rank(piece, list(range(ranks)), free, loads, holders), free, loads, holders)

    @staticmethod
    def _take(piece: _Piece, rank: int, free: list[Storage], loads: list[list[float]], holders: list[Counter[str]]) -> None:
        piece.option.shards[piece.index].rank = rank
        free[rank] -= piece.storage
        for m in range(_NUM_METRICS):
            loads[rank][m] += piece.vector[m]
        holders[rank][piece.table] += 1

    # -- greedy placement
    def _best_rank(
        self, piece: _Piece, candidates: list[int], free: list[Storage], loads: list[list[float]], holders: list[Counter[str]]
    ) -> int:
        fitting = [r for r in candidates if piece.storage.fits_in(free[r])]
        if not fitting:
            self._require_fit(piece, candidates, free)
        fresh = [r for r in fitting if not holders[r][piece.table]] or fitting
        w = self._ctx.balance.weights()

        def score(rank: int) -> tuple[float, float, int]:
            after = [loads[rank][m] + piece.vector[m] for m in range(_NUM_METRICS)]
            return (max(w[m] * after[m] for m in range(_NUM_METRICS)), sum(w[m] * after[m] ** 2 for m in range(_NUM_METRICS)), rank)

        return min(fresh, key=score)

    def _host_fits(self, pieces: list[_Piece], host: list[int], free: list[Storage], option: ShardingOption) -> bool:
        if option.sharding_type == ShardingType.TABLE_ROW_WISE.value:
            return len(pieces) == len(host) and all(p.storage.fits_in(free[r]) for p, r in zip(pieces, host))
        total = Storage(0, 0, 0)
        for p in pieces:
            total += p.storage
        room = Storage(0, 0, 0)
        for r in host:
            room += free[r]
        return total.fits_in(room)

    def _require_fit(self, piece: _Piece, candidates: list[int], free: list[Storage]) -> None:
        if any(piece.storage.fits_in(free[r]) for r in candidates):
            return
        tier = self._ctx.tier
        shard = piece.option.shards[piece.index]
        most = max(_bytes(free[r], tier) for r in candidates)
        raise PlannerError(
            f"table {piece.option.name!r} ({piece.option.fqn}): its {piece.option.sharding_type} shard {piece.index} "
            f"({shard.size[0]} x {shard.size[1]}) needs {_fmt_bytes(_bytes(piece.storage, tier))} of {tier.upper()}, "
            f"but the most any rank has left is {_fmt_bytes(most)}",
            PlannerErrorType.PARTITION,
        )

    # -- local search
    def _improve(self, movable: list[_Piece], free: list[Storage], loads: list[list[float]], holders: list[Counter[str]]) -> None:
        """Move or swap shards off the bottleneck ranks while the objective (then the spread) drops."""
        if not movable or len(loads) < 2:
            return
        balance = self._ctx.balance
        w = balance.weights()
        metrics = [m for m in range(_NUM_METRICS) if w[m] > 0]
        ranks = range(len(loads))
        by_rank: list[list[_Piece]] = [[] for _ in ranks]
        for piece in movable:
            by_rank[_rank(piece)].append(piece)
        # metric_cost(m, x, mean) = w x + slope * max(0, x - knee) with the means fixed while placing.
        means = [sum(loads[r][m] for r in ranks) / len(loads) for m in range(_NUM_METRICS)]
        knee = [(1.0 + balance.tolerance) * means[m] for m in range(_NUM_METRICS)]
        slope = [w[m] * balance.excess_penalty / means[m] if means[m] > 0 else 0.0 for m in range(_NUM_METRICS)]

        def cost(m: int, x: float) -> float:
            return w[m] * x + (slope[m] * (x - knee[m]) if x > knee[m] else 0.0)

        for _ in range(self._max_moves):
            tops = {m: sorted(((loads[r][m], r) for r in ranks), reverse=True)[:3] for m in metrics}
            current = sum(cost(m, tops[m][0][0]) for m in metrics)
            best_key: tuple[float, float] | None = None
            best_move: tuple[_Piece, int, _Piece | None] | None = None

            def gain(
                a: int, b: int, delta: Sequence[float], tops: dict[int, list[tuple[float, int]]] = tops, current: float = current
            ) -> tuple[float, float] | None:
                peak = 0.0
                spread = 0.0
                la, lb = loads[a], loads[b]
                for m in metrics:
                    top = tops[m]
                    rest = top[0][0] if top[0][1] != a and top[0][1] != b else (
                        top[1][0] if len(top) > 1 and top[1][1] != a and top[1][1] != b else (top[2][0] if len(top) > 2 else 0.0)
                    )
                    new_a, new_b = la[m] - delta[m], lb[m] + delta[m]
                    peak += cost(m, max(rest, new_a, new_b))
                    spread += w[m] * delta[m] * (lb[m] - la[m] + delta[m])
                if peak < current - _EPS or (peak <= current + _EPS and spread < -_EPS):
                    return (peak, spread)
                return None

            bottlenecks = sorted({tops[m][0][1] for m in metrics})
            for a in bottlenecks:
                for piece in by_rank[a]:
                    for b in ranks:
                        if b == a or holders[b][piece.table]:
                            continue
                        key = gain(a, b, piece.vector)
                        if key is not None and (best_key is None or key < best_key) and piece.storage.fits_in(free[b]):
                            best_key, best_move = key, (piece, b, None)
            if best_move is None:
                # Swaps with the pieces of the least loaded ranks only: the full neighbourhood is quadratic.
                light = sorted(ranks, key=lambda r: sum(w[m] * loads[r][m] for m in metrics))[: max(4, len(loads) // 8)]
                for a in bottlenecks:
                    for piece in by_rank[a]:
                        for b in light:
                            if b == a or holders[b][piece.table]:
                                continue
                            for other in by_rank[b]:
                                if other.table == piece.table or holders[a][other.table]:
                                    continue
                                delta = [piece.vector[m] - other.vector[m] for m in range(_NUM_METRICS)]
                                key = gain(a, b, delta)
                                if key is None or (best_key is not None and key >= best_key):
                                    continue
                                if piece.storage.fits_in(free[b] + other.storage) and other.storage.fits_in(free[a] + piece.storage):
                                    best_key, best_move = key, (piece, b, other)
            if best_move is None:
                return
            piece, b, other = best_move
            a = _rank(piece)
            self._move(piece, a, b, free, loads, holders, by_rank)
            if other is not None:
                self._move(other, b, a, free, loads, holders, by_rank)

    @staticmethod
    def _move(
        piece: _Piece, a: int, b: int, free: list[Storage], loads: list[list[float]], holders: list[Counter[str]], by_rank: list[list[_Piece]]
    ) -> None:
        piece.option.shards[piece.index].rank = b
        free[a] += piece.storage
        free[b] -= piece.storage
        for m in range(_NUM_METRICS):
            loads[a][m] -= piece.vector[m]
            loads[b][m] += piece.vector[m]
        holders[a][piece.table] -= 1
        holders[b][piece.table] += 1
        by_rank[a].remove(piece)
        by_rank[b].append(piece)


def _rank(piece: _Piece) -> int:
    rank = piece.option.shards[piece.index].rank
    assert rank is not None
    return rank


def _storage(shard: Shard) -> Storage:
    return copy.copy(shard.storage) if shard.storage is not None else Storage(0, 0, 0)


def _bytes(storage: Storage, tier: str) -> int:
    return int(getattr(storage, tier))


def _fmt_bytes(value: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


# ----------------------------------------------------------------------------------- proposer
@dataclass
class _Evaluated:
    rating: float
    choice: dict[str, int]
    bottlenecks: dict[int, list[str]]
    placement: dict[tuple[int, int], int]


class BalancedProposer(Proposer):
    """Steepest descent over sharding choices, from several starts, rated by the planner's loop.

    A start takes, per table, the cheapest option whose largest shard is at most a threshold share
    of an ideal rank's load (``inf``: the cheapest option); one descent runs per threshold in
    ``split_thresholds``, coarse to fine, since how finely to cut first decides which local optimum
    a descent reaches. Each round proposes the neighbours of the current choice:

    * for each metric, up to ``tables_per_round`` tables loading its bottleneck rank most, each
      re-sharded into up to ``options_per_table`` options whose largest shard is smaller on it;
    * up to ``tables_per_round`` tables re-sharded into a cheaper (coarser) option, which gives
      back the ids a column split copies to every shard.

    The best neighbour becomes current if it rates better; otherwise the descent ends. The planner
    keeps the best plan over all descents. When a proposal does not fit in memory, the table with
    the largest shard is re-sharded into smaller shards until one fits.
    """

    def __init__(
        self,
        context: BalanceContext,
        *,
        split_thresholds: Sequence[float] = (math.inf, 1.0, 0.5, 0.25),
        tables_per_round: int = 2,
        options_per_table: int = 1,
        max_rounds: int = 200,
    ) -> None:
        if not split_thresholds or any(t <= 0 for t in split_thresholds):
            raise ValueError(f"BalancedProposer(split_thresholds={list(split_thresholds)}) must be a non-empty list of values > 0.")
        for name, value in (("tables_per_round", tables_per_round), ("options_per_table", options_per_table), ("max_rounds", max_rounds)):
            if value < 1:
                raise ValueError(f"BalancedProposer({name}={value}) must be >= 1.")
        self._ctx = context
        self._thresholds = list(split_thresholds)
        self._tables_per_round = tables_per_round
        self._options_per_table = options_per_table
        self._max_rounds = max_rounds
        self._options: dict[str, list[ShardingOption]] = {}
        self._starts: list[dict[str, int]] = []
        self._queue: list[dict[str, int]] = []
        self._seen: set[tuple[tuple[str, int], ...]] = set()
        self._results: list[_Evaluated] = []
        self._current_rating = math.inf
        self.rounds_run = 0

    def load(self, search_space: list[ShardingOption], enumerator: Enumerator | None = None) -> None:
        ctx = self._ctx
        ctx.set_reference(search_space)
        self._options = {}
        for option in search_space:
            self._options.setdefault(option.fqn, []).append(option)
        for options in self._options.values():
            # A one-shard (table-)column-wise option is the table-wise option under another name.
            whole = {o.compute_kernel for o in options if o.sharding_type == ShardingType.TABLE_WISE.value}
            options[:] = [o for o in options if not (o.sharding_type in _COLUMN_TYPES and o.num_shards == 1 and o.compute_kernel in whole)]
            options.sort(key=lambda o: (ctx.total_cost(o), o.num_shards, o.sharding_type, o.compute_kernel))
        self._starts = [self._start(t) for t in self._thresholds]
        self._seen, self._results, self._queue, self.rounds_run = set(), [], [], 0
        self._next_descent()

    def _start(self, threshold: float) -> dict[str, int]:
        ctx = self._ctx
        start: dict[str, int] = {}
        for fqn, options in self._options.items():
            small = [i for i, o in enumerate(options) if ctx.largest_piece(o) <= threshold]
            start[fqn] = small[0] if small else min(range(len(options)), key=lambda i: (ctx.largest_piece(options[i]), i))
        return start

    def _next_descent(self) -> None:
        self._current_rating = math.inf
        self._ctx.warm_start = {}
        while self._starts and not self._queue:
            start = self._starts.pop(0)
            if self._key(start) not in self._seen:
                self._seen.add(self._key(start))
                self._queue = [start]

    def propose(self) -> list[ShardingOption] | None:
        if not self._queue:
            return None
        return [self._options[fqn][i] for fqn, i in self._queue[0].items()]

    def feedback(
        self,
        partitionable: bool,
        plan: list[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        if not self._queue:
            return
        choice = self._queue.pop(0)
        if partitionable and plan is not None and perf_rating is not None:
            placement = {(id(o), i): s.rank for o in plan for i, s in enumerate(o.shards) if s.rank is not None}
            self._results.append(_Evaluated(perf_rating, choice, self._bottlenecks(plan), placement))
        elif not math.isfinite(self._current_rating) and not self._results and not self._queue:
            self._queue = self._repair(choice)  # nothing of this descent fits yet: shrink the largest shard
            if not self._queue:
                self._next_descent()
            return
        if self._queue:
            return
        self.rounds_run += 1
        best = min(self._results, key=lambda e: e.rating, default=None)
        self._results = []
        if best is not None and best.rating < self._current_rating * (1 - 1e-9) and self.rounds_run < self._max_rounds:
            self._current_rating = best.rating
            self._ctx.warm_start = best.placement
            self._queue = self._neighbours(best)
        if not self._queue:
            if self.rounds_run >= self._max_rounds:
                self._starts = []
            self._next_descent()

    # -- neighbourhood
    def _key(self, choice: dict[str, int]) -> tuple[tuple[str, int], ...]:
        return tuple(sorted(choice.items()))

    def _bottlenecks(self, plan: list[ShardingOption]) -> dict[int, list[str]]:
        """Per weighted metric: the tables on its most loaded rank, biggest contribution first."""
        ctx = self._ctx
        loads = ctx.rank_loads(plan)
        w = ctx.balance.weights()
        result: dict[int, list[str]] = {}
        for m in range(_NUM_METRICS):
            if w[m] <= 0:
                continue
            rank = max(range(len(loads)), key=lambda r: loads[r][m])
            contribution: Counter[str] = Counter()
            for option in plan:
                for shard, u in zip(option.shards, ctx.normalized(option)):
                    if shard.rank == rank:
                        contribution[option.fqn] += u[m]
            result[m] = [fqn for fqn, _ in contribution.most_common()]
        return result

    def _add(self, out: list[dict[str, int]], base: dict[str, int], fqn: str, index: int) -> bool:
        candidate = dict(base)
        candidate[fqn] = index
        key = self._key(candidate)
        if key in self._seen:
            return False
        self._seen.add(key)
        out.append(candidate)
        return True

    def _neighbours(self, evaluated: _Evaluated) -> list[dict[str, int]]:
        ctx = self._ctx
        choice = evaluated.choice
        out: list[dict[str, int]] = []
        for metric, tables in evaluated.bottlenecks.items():
            taken = 0
            for fqn in tables:
                if taken >= self._tables_per_round:
                    break
                options = self._options[fqn]
                piece = ctx.largest_piece(options[choice[fqn]], metric)
                finer = [i for i, o in enumerate(options) if ctx.largest_piece(o, metric) < piece * (1 - 1e-9)]
                added = 0
                for i in finer:  # options are sorted by total cost: the cheapest finer ones first
                    added += self._add(out, choice, fqn, i)
                    if added >= self._options_per_table:
                        break
                taken += 1 if finer else 0
        overhead = sorted(
            ((ctx.total_cost(self._options[fqn][i]) - ctx.total_cost(self._options[fqn][0]), fqn) for fqn, i in choice.items()),
            reverse=True,
        )
        for extra, fqn in overhead[: self._tables_per_round]:
            if extra <= 0:
                break
            cheaper = [i for i in range(choice[fqn]) if ctx.total_cost(self._options[fqn][i]) < ctx.total_cost(self._options[fqn][choice[fqn]])]
            if cheaper:
                self._add(out, choice, fqn, cheaper[-1])  # the least coarsening step
        return out

    def _repair(self, failed: dict[str, int]) -> list[dict[str, int]]:
        ctx = self._ctx
        tier = ctx.tier

        def largest(option: ShardingOption) -> int:
            return max(_bytes(_storage(s), tier) for s in option.shards)

        for fqn in sorted(failed, key=lambda f: -largest(self._options[f][failed[f]])):
            options = self._options[fqn]
            limit = largest(options[failed[fqn]])
            for i in sorted((i for i, o in enumerate(options) if largest(o) < limit), key=lambda i: ctx.total_cost(options[i])):
                out: list[dict[str, int]] = []
                if self._add(out, failed, fqn, i):
                    return out
        return []


# ----------------------------------------------------------------------------------- planner
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
        local_world_size: ranks of the group per node (default: the whole group on one node).
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
    """

    def __init__(
        self,
        *,
        sharding_group_size: int,
        local_world_size: int | None = None,
        compute_device: str = "cpu",
        batch_size: int = 512,
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
        self.topology = make_topology(sharding_group_size, local_world_size, compute_device, memory_per_rank)
        self.sharding_group_size = sharding_group_size
        self.local_world_size = self.topology.local_world_size
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
        tables = embedding_tables(module)
        defaults = {n: c.pooling_factor for n, c in self.constraints.items() if c.pooling_factor is not None}
        stats, assumed = resolve_table_stats(tables, self.stats, defaults)
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
        """Plan on rank 0 of ``pg`` (default WORLD) and broadcast; a planning error is raised on every rank.

        TorchRec's ``collective_plan`` leaves the other ranks waiting in the broadcast when rank 0
        fails; here rank 0 broadcasts the error instead.
        """
        if sharders is None:
            raise ValueError("BalancedPlanner.collective_plan needs the sharders (the same ones DMP gets).")
        group = pg if pg is not None else dist.group.WORLD
        assert group is not None
        payload: list[Any] = [None]
        if dist.get_rank(group) == 0:
            try:
                payload = [("ok", self.plan(module, sharders))]
            except (PlannerError, ValueError, RuntimeError, TypeError) as err:
                payload = [("error", type(err).__name__, str(err), getattr(getattr(err, "error_type", None), "value", None))]
        if dist.get_world_size(group) > 1:
            dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
        result = payload[0]
        if result[0] == "ok":
            return result[1]
        _, kind, message, error_type = result
        if kind == "PlannerError":
            raise PlannerError(message, PlannerErrorType(error_type) if error_type else PlannerErrorType.OTHER)
        raise {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)(message)

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
        capacity = min(_bytes(d.storage, tier) for d in reserved.devices)
        per_table: dict[str, tuple[int, int, str]] = {}
        for option in search_space:
            biggest = max(_bytes(_storage(s), tier) for s in option.shards)
            total = sum(_bytes(_storage(s), tier) for s in option.shards)
            known = per_table.get(option.name)
            if known is None or biggest < known[0]:
                per_table[option.name] = (biggest, total, option.sharding_type)
        lines = [
            (
                f"BalancedPlanner: the tables do not fit in {tier.upper()} of the sharding group "
                f"({self.sharding_group_size} ranks x {_fmt_bytes(capacity)} left per rank after the storage reservation)."
            )
        ]
        too_big = sorted(((n, v) for n, v in per_table.items() if v[0] > capacity), key=lambda kv: -kv[1][0])
        for name, (biggest, _, sharding_type) in too_big:
            lines.append(
                f"  table {name!r} needs at least {_fmt_bytes(biggest)} on one rank (its smallest shard, {sharding_type}) "
                f"but a rank has {_fmt_bytes(capacity)}"
            )
        needed = sum(v[1] for v in per_table.values())
        if not too_big:
            lines.append(
                f"  together the tables need about {_fmt_bytes(needed)} but the group has {_fmt_bytes(capacity * self.sharding_group_size)}"
            )
        lines.append(
            "  Fix: raise memory_per_rank, use a larger sharding group, allow row_wise/column_wise for the large tables, "
            "or shrink them (rows, dim)."
        )
        return "\n".join(lines)


def make_balanced_plan(
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    *,
    sharding_group_size: int,
    local_world_size: int,
    compute_device: str,
    constraints: dict[str, TableConstraints] | None = None,
    batch_size: int | None = None,
    stats: Mapping[str, TableStats] | LoadProfile | None = None,
    hash_partitions: Mapping[str, int] | None = None,
    **planner_kwargs: Any,
) -> tuple[ShardingPlan, BalancedPlanner]:
    """``make_sharding_plan``'s counterpart: plan on global rank 0 with ``BalancedPlanner``, broadcast over WORLD.

    Returns the plan and the planner (its ``last_result`` is set on rank 0 only).
    """
    planner = BalancedPlanner(
        sharding_group_size=sharding_group_size,
        local_world_size=local_world_size,
        compute_device=compute_device,
        batch_size=batch_size or 512,
        stats=stats,
        constraints=constraints,
        hash_partitions=hash_partitions,
        **planner_kwargs,
    )
    if dist.is_initialized():
        return planner.collective_plan(module, sharders, dist.group.WORLD), planner
    return planner.plan(module, sharders), planner

"""The state the balanced planner's enumerator, proposer, partitioner and perf model share.

``BalanceContext`` prices every shard of a sharding option with the shard cost model
(``lightning_recsys.planner.shard_cost``), in units of an ideal rank's load per metric, and rates
per-rank loads by the ``BalanceObjective``. No Lightning imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torchrec.distributed.planner.types import PlannerError, PlannerErrorType, ShardingOption

from lightning_recsys.planner.shard_cost import BalanceObjective, CommCosts, ShardCost, shard_cost
from lightning_recsys.planner.stats import TableStats

NUM_METRICS = 4  # storage, lookups, comm bytes, step time: the order of ShardCost.vector()
EPS = 1e-12


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
    refs: tuple[float, ...] = (1.0,) * NUM_METRICS
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
        return sum(w[m] * u[m] for u in self.normalized(option) for m in range(NUM_METRICS))

    def largest_piece(self, option: ShardingOption, metric: int | None = None) -> float:
        """The largest shard of the option on ``metric`` (or on its worst weighted metric)."""
        w = self.balance.weights()
        pieces = self.normalized(option)
        if metric is not None:
            return max(u[metric] for u in pieces)
        return max(max(u[m] for m in range(NUM_METRICS) if w[m] > 0) for u in pieces)

    def set_reference(self, search_space: Sequence[ShardingOption]) -> None:
        """``ref_m``: the per-rank share of the sum, over tables, of each table's cheapest option on ``m``."""
        cheapest: dict[str, list[float]] = {}
        for option in search_space:
            totals = [sum(c.vector()[m] for c in self.costs(option)) for m in range(NUM_METRICS)]
            best = cheapest.setdefault(option.fqn, totals)
            cheapest[option.fqn] = [min(a, b) for a, b in zip(best, totals)]
        refs = [sum(t[m] for t in cheapest.values()) / self.group_size for m in range(NUM_METRICS)]
        self.refs = tuple(r if r > 0 else 1.0 for r in refs)  # type: ignore[assignment]

    def rank_loads(self, plan: Sequence[ShardingOption]) -> list[list[float]]:
        loads = [[0.0] * NUM_METRICS for _ in range(self.group_size)]
        for option in plan:
            for shard, u in zip(option.shards, self.normalized(option)):
                if shard.rank is None:
                    raise PlannerError(f"shard of {option.fqn} has no rank", PlannerErrorType.INVALID_RANK_ASSIGNMENT)
                for m in range(NUM_METRICS):
                    loads[shard.rank][m] += u[m]
        return loads

    def objective(self, loads: Sequence[Sequence[float]]) -> float:
        ranks = len(loads)
        return sum(
            self.balance.metric_cost(m, max(row[m] for row in loads), sum(row[m] for row in loads) / ranks)
            for m in range(NUM_METRICS)
        )

"""BalancedProposer: steepest descents over the tables' sharding options. No Lightning imports."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from torchrec.distributed.planner.types import Enumerator, Proposer, ShardingOption, Topology
from torchrec.distributed.types import ShardingType

from lightning_recsys.parallel.sharding import COLUMN_SHARDED_TYPES
from lightning_recsys.planner.balanced.context import NUM_METRICS, BalanceContext
from lightning_recsys.planner.shard_cost import shard_storage, tier_bytes


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
            options[:] = [o for o in options if not (o.sharding_type in COLUMN_SHARDED_TYPES and o.num_shards == 1 and o.compute_kernel in whole)]
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
        for m in range(NUM_METRICS):
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
            return max(tier_bytes(shard_storage(s), tier) for s in option.shards)

        for fqn in sorted(failed, key=lambda f: -largest(self._options[f][failed[f]])):
            options = self._options[fqn]
            limit = largest(options[failed[fqn]])
            for i in sorted((i for i, o in enumerate(options) if largest(o) < limit), key=lambda i: ctx.total_cost(options[i])):
                out: list[dict[str, int]] = []
                if self._add(out, failed, fqn, i):
                    return out
        return []

"""BalancedPartitioner: places shards so no rank carries more than balance needs. No Lightning imports."""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from torchrec.distributed.planner.types import (
    PartitionByType,
    Partitioner,
    PlannerError,
    PlannerErrorType,
    ShardingOption,
    Storage,
    Topology,
)
from torchrec.distributed.types import ShardingType

from lightning_recsys.planner.balanced.context import EPS, NUM_METRICS, BalanceContext
from lightning_recsys.planner.shard_cost import format_bytes, shard_storage, tier_bytes

_MOVABLE = (PartitionByType.DEVICE.value,)


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
        loads = [[0.0] * NUM_METRICS for _ in range(ranks)]
        holders: list[Counter[str]] = [Counter() for _ in range(ranks)]
        host = max(1, min(ctx.intra_group_size, ranks))
        hosts = [list(range(h * host, (h + 1) * host)) for h in range(ranks // host)]

        def place(piece: _Piece, rank: int) -> None:
            self._take(piece, rank, free, loads, holders)

        def pieces_of(option: ShardingOption) -> list[_Piece]:
            return [
                _Piece(option, i, u, shard_storage(shard))
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
                needed = sum(tier_bytes(p.storage, ctx.tier) for p in pieces)
                room = max(sum(tier_bytes(free[r], ctx.tier) for r in h) for h in hosts)
                raise PlannerError(
                    f"table {option.name!r} ({option.fqn}): its {option.sharding_type} shards need {format_bytes(needed)} of "
                    f"{ctx.tier.upper()} on one node, but the most any node has left is {format_bytes(room)}",
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
            if value < best_value - EPS:
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
        fresh.sort(key=lambda p: (-max(weights[m] * p.vector[m] for m in range(NUM_METRICS)), p.table, p.index))
        for piece in fresh:
            self._take(piece, self._best_rank(piece, list(range(ranks)), free, loads, holders), free, loads, holders)

    @staticmethod
    def _take(piece: _Piece, rank: int, free: list[Storage], loads: list[list[float]], holders: list[Counter[str]]) -> None:
        piece.option.shards[piece.index].rank = rank
        free[rank] -= piece.storage
        for m in range(NUM_METRICS):
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
            after = [loads[rank][m] + piece.vector[m] for m in range(NUM_METRICS)]
            return (max(w[m] * after[m] for m in range(NUM_METRICS)), sum(w[m] * after[m] ** 2 for m in range(NUM_METRICS)), rank)

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
        most = max(tier_bytes(free[r], tier) for r in candidates)
        raise PlannerError(
            f"table {piece.option.name!r} ({piece.option.fqn}): its {piece.option.sharding_type} shard {piece.index} "
            f"({shard.size[0]} x {shard.size[1]}) needs {format_bytes(tier_bytes(piece.storage, tier))} of {tier.upper()}, "
            f"but the most any rank has left is {format_bytes(most)}",
            PlannerErrorType.PARTITION,
        )

    # -- local search
    def _improve(self, movable: list[_Piece], free: list[Storage], loads: list[list[float]], holders: list[Counter[str]]) -> None:
        """Move or swap shards off the bottleneck ranks while the objective (then the spread) drops."""
        if not movable or len(loads) < 2:
            return
        balance = self._ctx.balance
        w = balance.weights()
        metrics = [m for m in range(NUM_METRICS) if w[m] > 0]
        ranks = range(len(loads))
        by_rank: list[list[_Piece]] = [[] for _ in ranks]
        for piece in movable:
            by_rank[_rank(piece)].append(piece)
        # metric_cost(m, x, mean) = w x + slope * max(0, x - knee) with the means fixed while placing.
        means = [sum(loads[r][m] for r in ranks) / len(loads) for m in range(NUM_METRICS)]
        knee = [(1.0 + balance.tolerance) * means[m] for m in range(NUM_METRICS)]
        slope = [w[m] * balance.excess_penalty / means[m] if means[m] > 0 else 0.0 for m in range(NUM_METRICS)]

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
                if peak < current - EPS or (peak <= current + EPS and spread < -EPS):
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
                                delta = [piece.vector[m] - other.vector[m] for m in range(NUM_METRICS)]
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
        for m in range(NUM_METRICS):
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

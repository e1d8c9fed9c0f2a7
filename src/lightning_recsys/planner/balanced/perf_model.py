"""BalancedPerfModel: rates a placed plan by the balance objective. No Lightning imports."""

from __future__ import annotations

from torchrec.distributed.planner.types import PerfModel, ShardingOption

from lightning_recsys.planner.balanced.context import BalanceContext


class BalancedPerfModel(PerfModel):
    """Rates a placed plan by the ``BalanceObjective`` of its per-rank loads (lower is better)."""

    def __init__(self, context: BalanceContext) -> None:
        self._ctx = context

    def rate(self, plan: list[ShardingOption]) -> float:
        return self._ctx.objective(self._ctx.rank_loads(plan))

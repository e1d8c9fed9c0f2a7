"""Sharding plans for the sharding group: TorchRec default and load-balanced planning, plan reports, reshape advice.

No Lightning imports.
"""

from lightning_recsys.planner.balanced import (
    BalancedEnumerator,
    BalancedPartitioner,
    BalancedPerfModel,
    BalancedPlanner,
    BalancedProposer,
    PlanResult,
    embedding_tables,
    make_balanced_plan,
    torchrec_constraints,
)
from lightning_recsys.planner.load_model import (
    BalanceObjective,
    CommCosts,
    Imbalance,
    WireFormat,
)
from lightning_recsys.planner.plan import (
    TableConstraints,
    make_sharding_plan,
    plan_rows,
    summarize_plan,
)
from lightning_recsys.planner.report import (
    PlanReport,
    RankReport,
    ShardReport,
    TableReport,
    build_plan_report,
)
from lightning_recsys.planner.reshape import (
    ReshapeAdvice,
    ReshapedEmbeddingBagCollection,
    apply_reshape,
    suggest_reshape,
)
from lightning_recsys.planner.stats import LoadProfile, TableStats, profile_datamodule

__all__ = [
    "BalanceObjective",
    "BalancedEnumerator",
    "BalancedPartitioner",
    "BalancedPerfModel",
    "BalancedPlanner",
    "BalancedProposer",
    "CommCosts",
    "Imbalance",
    "LoadProfile",
    "PlanReport",
    "PlanResult",
    "RankReport",
    "ReshapeAdvice",
    "ReshapedEmbeddingBagCollection",
    "ShardReport",
    "TableConstraints",
    "TableReport",
    "TableStats",
    "WireFormat",
    "apply_reshape",
    "build_plan_report",
    "embedding_tables",
    "make_balanced_plan",
    "make_sharding_plan",
    "plan_rows",
    "profile_datamodule",
    "suggest_reshape",
    "summarize_plan",
    "torchrec_constraints",
]

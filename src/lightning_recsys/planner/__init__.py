"""Sharding plans for one sharding group: TorchRec's and the balanced planner, plan reports, reshape advice.

``PlanningPipeline`` (``pipeline.py``) is the one way a plan is made, by the strategy at setup and
by ``lightning-recsys plan``: profile, stats, reshape advice, plan on rank 0 for every rank, report.
No Lightning imports.
"""

from lightning_recsys.parallel.sharding import ReshapedEmbeddingBagCollection, apply_reshape, plan_rows, summarize_plan
from lightning_recsys.planner.balanced import (
    BalancedEnumerator,
    BalancedPartitioner,
    BalancedPerfModel,
    BalancedPlanner,
    BalancedProposer,
    PlanResult,
    make_balanced_plan,
)
from lightning_recsys.planner.config import PlanningConfig
from lightning_recsys.planner.constraints import TableConstraints, torchrec_constraints
from lightning_recsys.planner.pipeline import PlannedSharding, PlanningInputs, PlanningPipeline
from lightning_recsys.planner.report import (
    PlanReport,
    RankReport,
    ShardReport,
    TableReport,
    build_plan_report,
)
from lightning_recsys.planner.reshape import ReshapeAdvice, suggest_reshape
from lightning_recsys.planner.shard_cost import (
    BalanceObjective,
    CommCosts,
    Imbalance,
    WireFormat,
)
from lightning_recsys.planner.stats import LoadProfile, TableStats, profile_datamodule
from lightning_recsys.planner.tables import ModelTables, embedding_tables, model_tables
from lightning_recsys.planner.torchrec_planner import make_sharding_plan

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
    "ModelTables",
    "PlanReport",
    "PlanResult",
    "PlannedSharding",
    "PlanningConfig",
    "PlanningInputs",
    "PlanningPipeline",
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
    "model_tables",
    "plan_rows",
    "profile_datamodule",
    "suggest_reshape",
    "summarize_plan",
    "torchrec_constraints",
]

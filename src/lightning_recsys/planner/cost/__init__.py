"""Cost models: bytes per collective to step time (``cost_model``), a workload's bytes (``traffic_model``; a pretrainer's in ``pretrain_traffic``)
and a ranking of candidate layouts (``layout_advice``). They run no collective; ``lightning-recsys plan``
and the benchmarks ask them for advice. No Lightning imports."""

from lightning_recsys.planner.cost.cost_model import (
    Cluster,
    Collective,
    Link,
    Parallelism,
    StepEstimate,
    Workload,
    step_time,
    topology_for,
)
from lightning_recsys.planner.cost.layout_advice import Advice, Hardware, advise_from_report, parse_cluster, recommend
from lightning_recsys.planner.cost.pretrain_traffic import PretrainItemFeature, PretrainWorkload, ranking_eval_traffic
from lightning_recsys.planner.cost.traffic_model import Feature, ModelShape, StrategyChoice, workload_traffic

__all__ = [
    "Advice",
    "Cluster",
    "Collective",
    "Feature",
    "Hardware",
    "Link",
    "ModelShape",
    "Parallelism",
    "PretrainItemFeature",
    "PretrainWorkload",
    "StepEstimate",
    "StrategyChoice",
    "Workload",
    "advise_from_report",
    "parse_cluster",
    "ranking_eval_traffic",
    "recommend",
    "step_time",
    "topology_for",
    "workload_traffic",
]

"""What ``TwoDRecStrategy`` plans with, read in one place: by its setup and by ``lightning-recsys plan``.

The planning pipeline itself (``lightning_recsys.planner.pipeline``) knows no strategy; these
functions turn a configured strategy into its inputs, so the command plans exactly as training does.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import nn
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from lightning_recsys.parallel import EmbeddingOptimizerConfig
from lightning_recsys.parallel.comms import QCommsCodecs, QCommsConfig, resolve_qcomms
from lightning_recsys.parallel.sharding import check_index_dedup_runs, make_sharders, supported_sharding_types
from lightning_recsys.parallel.topology import Layout, ParallelTopology
from lightning_recsys.planner import PlanningConfig


class PlanningSettings(Protocol):
    """What planning reads of a strategy (``TwoDRecStrategy``'s settings): its layout and its configs."""

    sharding_group_size: Optional[int]
    layout: Layout
    planning: PlanningConfig
    qcomms_config: QCommsConfig
    embedding_optimizer_config: EmbeddingOptimizerConfig


def planning_topology(
    strategy: PlanningSettings, *, world_size: int, ranks_per_node: int, sharding_group_size: int | None = None
) -> ParallelTopology:
    """The world layout the strategy builds for ``world_size`` ranks, ``ranks_per_node`` on each node.

    ``sharding_group_size`` overrides the strategy's (whose default is the ranks per node).
    """
    if world_size % ranks_per_node:
        raise ValueError(f"world_size={world_size} is not a whole number of nodes of {ranks_per_node} ranks.")
    return ParallelTopology.for_world(
        ranks_per_node=ranks_per_node,
        num_nodes=world_size // ranks_per_node,
        sharding_group_size=sharding_group_size or strategy.sharding_group_size,
        layout=strategy.layout,
    )


def planning_sharders(
    strategy: PlanningSettings,
    *,
    compute_device: str,
    topology: ParallelTopology,
    plan: ShardingPlan | None = None,
    device: torch.device | None = None,
) -> tuple[list[ModuleSharder[nn.Module]], QCommsCodecs]:
    """The sharders and their QComms codecs: the planner's (``plan=None``), or DMP's final ones for ``plan``.

    Both are built from the strategy's requested precisions. The planner reads only the codecs'
    wire dtypes; the final codecs take their scale-block size (and any fallback it forces) from the
    plan's shard widths. ``device`` picks FBGEMM's kernels on CUDA.
    """
    allowed = strategy.planning.sharding_types
    if allowed is None and not topology.is_1d:
        allowed = supported_sharding_types(compute_device, two_d=True)
    codecs = QCommsCodecs.build(resolve_qcomms(strategy.qcomms_config), plan, device=device)
    fused = strategy.embedding_optimizer_config.fused_params()
    dedup = strategy.qcomms_config.index_dedup
    if dedup:
        check_index_dedup_runs(compute_device)
    return make_sharders(fused, allowed, qcomm_codecs_registry=codecs.registry, index_dedup=dedup), codecs

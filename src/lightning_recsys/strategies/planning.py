"""What ``TwoDRecStrategy`` plans with, read in one place: by its setup and by ``lightning-recsys plan``.

The planning pipeline itself (``lightning_recsys.planner.pipeline``) knows no strategy; these
functions turn a configured strategy into its inputs, so the command plans exactly as training does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torchrec.distributed.types import ModuleSharder

from lightning_recsys.parallel.qcomms import QCommsCodecs
from lightning_recsys.parallel.sharders import make_sharders, supported_sharding_types
from lightning_recsys.parallel.topology import ParallelTopology
from lightning_recsys.planner.pipeline import PlanningConfig

if TYPE_CHECKING:
    from lightning_recsys.strategies.twod_rec import TwoDRecStrategy


def planning_config(strategy: TwoDRecStrategy) -> PlanningConfig:
    """The strategy's planner settings."""
    return PlanningConfig(
        planner=strategy._planner,
        table_constraints=dict(strategy._table_constraints),
        planner_stats=strategy._planner_stats,
        profile_batches=strategy._profile_batches,
        hash_partitions=strategy._hash_partitions,
        reshape_tables=strategy._reshape_tables,
    )


def planning_topology(
    strategy: TwoDRecStrategy, *, world_size: int, ranks_per_node: int, sharding_group_size: int | None = None
) -> ParallelTopology:
    """The world layout the strategy builds for ``world_size`` ranks, ``ranks_per_node`` on each node.

    ``sharding_group_size`` overrides the strategy's (whose default is the ranks per node).
    """
    return ParallelTopology(
        world_size=world_size,
        sharding_group_size=sharding_group_size or strategy._sharding_group_size or ranks_per_node,
        layout=strategy._layout,
        ranks_per_node=ranks_per_node,
    )


def planning_sharders(
    strategy: TwoDRecStrategy, *, compute_device: str, topology: ParallelTopology
) -> tuple[list[ModuleSharder[nn.Module]], QCommsCodecs]:
    """The sharders the strategy gives the planner and DMP, and the QComms codecs inside them."""
    allowed = strategy._sharding_types
    if allowed is None and not topology.is_1d:
        allowed = supported_sharding_types(compute_device, two_d=True)
    codecs = QCommsCodecs.build(strategy.effective_qcomms)
    sharders = make_sharders(strategy.embedding_optimizer_config.fused_params(), allowed, qcomm_codecs_registry=codecs.registry)
    return sharders, codecs

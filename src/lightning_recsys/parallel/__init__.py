"""Trainer-free core, one concern per subpackage. No Lightning imports.

``topology/`` the 2D rank layout and its process groups; ``comms/`` QComms codecs, bytes per
collective, the dense all-reduce; ``input/`` batch checks and the sparse-dist pipeline; ``sync/`` the
replica sync; ``sharding/`` sharders, reshaped tables, the sharded model and its runtime.
"""

from lightning_recsys.parallel.sharding import (
    ALL_SHARDING_TYPES,
    EmbeddingOptimizerConfig,
    ReshapedEmbeddingBagCollection,
    ShardedModel,
    apply_reshape,
    make_sharders,
    plan_rows,
    shard_model,
    summarize_plan,
    supported_sharding_types,
)
from lightning_recsys.parallel.topology import ParallelTopology

__all__ = [
    "ALL_SHARDING_TYPES",
    "EmbeddingOptimizerConfig",
    "ParallelTopology",
    "ReshapedEmbeddingBagCollection",
    "ShardedModel",
    "apply_reshape",
    "make_sharders",
    "plan_rows",
    "shard_model",
    "summarize_plan",
    "supported_sharding_types",
]

"""Trainer-free core: rank topology, sharders, table reshapes, sharded model construction. No Lightning imports."""

from lightning_recsys.parallel.embedding_optimizer import EmbeddingOptimizerConfig
from lightning_recsys.parallel.reshape import ReshapedEmbeddingBagCollection, apply_reshape
from lightning_recsys.parallel.sharded_model import ShardedModel, shard_model
from lightning_recsys.parallel.sharders import ALL_SHARDING_TYPES, make_sharders, supported_sharding_types
from lightning_recsys.parallel.sharding_plan import plan_rows, summarize_plan
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

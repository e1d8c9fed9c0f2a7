"""Trainer-free core: rank topology, sharders, sharded model construction. No Lightning imports."""

from lightning_recsys.parallel.embedding_optimizer import EmbeddingOptimizerConfig
from lightning_recsys.parallel.sharded_model import ShardedModel, shard_model
from lightning_recsys.parallel.sharders import ALL_SHARDING_TYPES, make_sharders, supported_sharding_types
from lightning_recsys.parallel.topology import ParallelTopology

__all__ = [
    "ALL_SHARDING_TYPES",
    "EmbeddingOptimizerConfig",
    "ParallelTopology",
    "ShardedModel",
    "make_sharders",
    "shard_model",
    "supported_sharding_types",
]

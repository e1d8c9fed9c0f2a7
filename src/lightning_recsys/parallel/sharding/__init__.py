"""The sharded model: TorchRec sharders, reshaped tables, DMP over a sharding group with the plan
remapped to global ranks, the tables' optimizer and learning rate, and ``ShardedRuntime`` (a sharded model
at run time)."""

from lightning_recsys.parallel.sharding.embedding_lr import EmbeddingLearningRate
from lightning_recsys.parallel.sharding.embedding_optimizer import EmbeddingOptimizerConfig
from lightning_recsys.parallel.sharding.reshape import (
    RESHAPE_CHECKPOINT_KEY,
    ReshapedEmbeddingBagCollection,
    apply_recorded_reshape,
    apply_reshape,
    reshape_record,
)
from lightning_recsys.parallel.sharding.runtime import ShardedRuntime
from lightning_recsys.parallel.sharding.sharded_model import ShardedModel, find_embedding_modules, shard_model
from lightning_recsys.parallel.sharding.index_dedup import check_index_dedup_runs, install_cpu_jagged_unique_indices
from lightning_recsys.parallel.sharding.sharders import (
    ALL_SHARDING_TYPES,
    COLUMN_SHARDED_TYPES,
    ROW_SHARDED_TYPES,
    make_sharders,
    supported_sharding_types,
    validate_sharding_types,
)
from lightning_recsys.parallel.sharding.sharding_plan import plan_rows, summarize_plan
from lightning_recsys.parallel.sharding.upstream_warnings import silence_known_upstream_warnings

__all__ = [
    "ALL_SHARDING_TYPES",
    "COLUMN_SHARDED_TYPES",
    "EmbeddingLearningRate",
    "EmbeddingOptimizerConfig",
    "RESHAPE_CHECKPOINT_KEY",
    "ROW_SHARDED_TYPES",
    "ReshapedEmbeddingBagCollection",
    "ShardedModel",
    "ShardedRuntime",
    "apply_recorded_reshape",
    "apply_reshape",
    "find_embedding_modules",
    "check_index_dedup_runs",
    "install_cpu_jagged_unique_indices",
    "make_sharders",
    "plan_rows",
    "reshape_record",
    "shard_model",
    "silence_known_upstream_warnings",
    "summarize_plan",
    "supported_sharding_types",
    "validate_sharding_types",
]

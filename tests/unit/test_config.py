"""Constructor validation: every bad argument names itself, its value and the rule."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from lightning_recsys import (
    EmbeddingOptimizerConfig,
    GuardConfig,
    PlanningConfig,
    ReplicaSyncConfig,
    TableConstraints,
    TwoDRecStrategy,
)
from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import DCNRanker, DLRMRanker

# Each row: the constructor, the bad keyword arguments, and the error it must raise.
_INVALID_CONSTRUCTIONS = [
    (EmbeddingOptimizerConfig, {"name": "lamb"}, r"name='lamb'\) is not supported; choose one of"),
    (EmbeddingOptimizerConfig, {"lr": 0.0}, r"lr=0.0\) must be > 0"),
    (EmbeddingOptimizerConfig, {"eps": -1.0}, r"eps=-1.0\) must be > 0"),
    (EmbeddingOptimizerConfig, {"weight_decay": -0.1}, r"weight_decay=-0.1\) must be >= 0"),
    (EmbeddingOptimizerConfig, {"beta1": 1.0}, r"beta1=1.0\) must be in \[0, 1\)"),
    (PlanningConfig, {"sharding_types": ["diagonal"]}, r"sharding_types\) contains 'diagonal', which is not one of"),
    (PlanningConfig, {"sharding_types": []}, r"sharding_types=\[\]\) allows no sharding type"),
    (PlanningConfig, {"planner": "greedy"}, r"planner='greedy'\) is not one of \['torchrec', 'balanced'\]"),
    (PlanningConfig, {"hash_partitions": {"t": 4}, "sharding_types": ["table_wise"]}, r"does not allow 'row_wise'"),
    (GuardConfig, {"validate_inputs": "sometimes"}, r"validate_inputs='sometimes'\) is not one of \['error', 'warn', 'off'\]"),
    (GuardConfig, {"check_finite": "yes"}, r"check_finite='yes'\) must be a bool"),
    (EmbeddingOptimizerConfig, {"lr_follows_scheduler": 1}, r"lr_follows_scheduler=1\) must be a bool"),
    (TwoDRecStrategy, {"process_group_timeout": 0}, r"process_group_timeout=0 must be > 0 seconds"),
    (TwoDRecStrategy, {"process_group_backend": "mpi"}, r"process_group_backend='mpi' must be 'gloo', 'nccl' or None"),
    (TwoDRecStrategy, {"sharding_group_size": 0}, r"sharding_group_size=0 must be an integer >= 1, or None"),
    (TwoDRecStrategy, {"layout": "ring"}, r"layout='ring' is not one of \['all_to_all_optimized', 'all_reduce_optimized'\]"),
    (ReplicaSyncConfig, {"every_n_steps": 0}, r"every_n_steps=0 must be an integer >= 1"),
    (ReplicaSyncConfig, {"every_n_steps": 1.5}, r"every_n_steps=1.5 must be an integer >= 1"),
    (TableConstraints, {"sharding_types": ["row_wise", "bogus"]}, r"sharding_types=\[..., 'bogus', ...\]\): not one of"),
    (TableConstraints, {"compute_kernels": ["magic"]}, r"compute_kernels=\[..., 'magic', ...\]\): not one of"),
    (TableConstraints, {"min_partition": 0}, r"min_partition=0\) must be >= 1"),
    (TableConstraints, {"pooling_factor": 0.0}, r"pooling_factor=0.0\) must be > 0"),
    (SyntheticClickLogConfig, {"table_sizes": [10, 0]}, r"table_sizes=\[10, 0\] must be a non-empty list of positive row counts"),
    (SyntheticClickLogConfig, {"pooling_factors": [1.0, 2.0]}, r"pooling_factors has 2 entries but table_sizes has 8"),
    (SyntheticClickLogConfig, {"pooling_factors": 0.5}, r"pooling_factors=0.5 must all be >= 1"),
    (SyntheticClickLogConfig, {"zipf_exponent": -1.0}, r"zipf_exponent=-1.0 must be >= 0"),
    (SyntheticClickLogConfig, {"global_batch_size": 0}, r"global_batch_size=0 must be >= 1"),
    # The DataModule validates its keyword arguments at construction, with the config's messages.
    (SyntheticClickLogDataModule, {"table_sizes": [10, 0]}, r"table_sizes=\[10, 0\] must be a non-empty list of positive row counts"),
    (SyntheticClickLogDataModule, {"pooling_factors": [1.0, 2.0]}, r"pooling_factors has 2 entries but table_sizes has 8"),
    (SyntheticClickLogDataModule, {"val_batches": -1}, r"val_batches=-1 must be >= 0"),
    (DLRMRanker, {"table_sizes": []}, r"table_sizes=\[\] gives the model no embedding table"),
    (DLRMRanker, {"table_sizes": [5], "embedding_dim": 8, "dense_arch_layer_sizes": [16, 4]}, r"must end in embedding_dim=8"),
    (DLRMRanker, {"table_sizes": [5], "over_arch_layer_sizes": [8, 2]}, r"over_arch_layer_sizes=\[8, 2\] must end in 1"),
    (DLRMRanker, {"table_sizes": [5], "over_arch_layer_sizes": [1]}, r"over_arch_layer_sizes=\[1\] must have at least two layers"),
    (DCNRanker, {"table_sizes": [5], "over_arch_layer_sizes": [1]}, r"over_arch_layer_sizes=\[1\] must have at least two layers"),
    (DLRMRanker, {"table_sizes": [5, 6], "feature_names": ["a"]}, r"feature_names has 1 entries but table_sizes has 2"),
    (DLRMRanker, {"table_sizes": [5], "dense_optimizer": "lbfgs"}, r"dense_optimizer='lbfgs' is not one of"),
]


@pytest.mark.parametrize(("constructor", "kwargs", "message"), _INVALID_CONSTRUCTIONS)
def test_invalid_arguments_are_rejected_with_their_rule(constructor, kwargs, message):
    with pytest.raises(ValueError, match=message):
        constructor(**kwargs)


def test_embedding_optimizer_maps_to_fbgemm_and_torch():
    config = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.2, eps=1e-6)
    assert config.fused_params()["optimizer"] == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    assert config.fused_params()["learning_rate"] == 0.2
    optimizer = EmbeddingOptimizerConfig(name="sgd", lr=0.3).make_torch_optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == 0.3


def test_adam_is_refused_on_cpu_for_model_parallel_tables():
    config = EmbeddingOptimizerConfig(name="adam")
    with pytest.raises(ValueError, match=r"name='adam'\) is not supported by FBGEMM's fused CPU kernels"):
        config.check_device("cpu", None)
    config.check_device("cpu", ["data_parallel"])
    config.check_device("cuda", None)


def test_strategy_rejects_wrong_embedding_optimizer_type():
    with pytest.raises(TypeError, match=r"embedding_optimizer='sgd'\): expected an EmbeddingOptimizerConfig"):
        TwoDRecStrategy(embedding_optimizer="sgd")  # type: ignore[arg-type]


def test_dlrm_builds_on_meta_device():
    model = DLRMRanker(table_sizes=[10**7, 10**7], embedding_dim=16, embedding_device="meta")
    tables = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    assert tables and all(p.is_meta for p in tables)

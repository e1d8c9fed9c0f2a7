"""Constructor validation: every bad argument names itself, its value and the rule."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from lightning_recsys import EmbeddingOptimizerConfig, TableConstraints, TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLogConfig
from lightning_recsys.models import DLRMRanker


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "lamb"}, r"name='lamb'\) is not supported; choose one of"),
        ({"lr": 0.0}, r"lr=0.0\) must be > 0"),
        ({"eps": -1.0}, r"eps=-1.0\) must be > 0"),
        ({"weight_decay": -0.1}, r"weight_decay=-0.1\) must be >= 0"),
        ({"beta1": 1.0}, r"beta1=1.0\) must be in \[0, 1\)"),
    ],
)
def test_embedding_optimizer_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EmbeddingOptimizerConfig(**kwargs)


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


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sharding_types": ["diagonal"]}, r"sharding_types contains 'diagonal', which is not one of"),
        ({"sharding_types": []}, r"sharding_types=\[\] allows no sharding type"),
        ({"process_group_timeout": 0}, r"process_group_timeout=0 must be > 0 seconds"),
        ({"process_group_backend": "mpi"}, r"process_group_backend='mpi' must be 'gloo', 'nccl' or None"),
    ],
)
def test_strategy_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TwoDRecStrategy(**kwargs)


def test_strategy_rejects_wrong_embedding_optimizer_type():
    with pytest.raises(TypeError, match=r"embedding_optimizer='sgd' must be an EmbeddingOptimizerConfig"):
        TwoDRecStrategy(embedding_optimizer="sgd")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sharding_types": ["row_wise", "bogus"]}, r"sharding_types=\[..., 'bogus', ...\]\): not one of"),
        ({"compute_kernels": ["magic"]}, r"compute_kernels=\[..., 'magic', ...\]\): not one of"),
        ({"min_partition": 0}, r"min_partition=0\) must be >= 1"),
        ({"pooling_factor": 0.0}, r"pooling_factor=0.0\) must be > 0"),
    ],
)
def test_table_constraints_reject(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TableConstraints(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"table_sizes": [10, 0]}, r"table_sizes=\[10, 0\] must be a non-empty list of positive row counts"),
        ({"pooling_factors": [1.0, 2.0]}, r"pooling_factors has 2 entries but table_sizes has 8"),
        ({"pooling_factors": 0.5}, r"pooling_factors=0.5 must all be >= 1"),
        ({"zipf_exponent": -1.0}, r"zipf_exponent=-1.0 must be >= 0"),
        ({"global_batch_size": 0}, r"global_batch_size=0 must be >= 1"),
    ],
)
def test_synthetic_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticClickLogConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"table_sizes": []}, r"table_sizes=\[\] gives the model no embedding table"),
        ({"table_sizes": [5], "embedding_dim": 8, "dense_arch_layer_sizes": [16, 4]}, r"must end in embedding_dim=8"),
        ({"table_sizes": [5], "over_arch_layer_sizes": [8, 2]}, r"over_arch_layer_sizes=\[8, 2\] must end in 1"),
        ({"table_sizes": [5, 6], "feature_names": ["a"]}, r"feature_names has 1 entries but table_sizes has 2"),
        ({"table_sizes": [5], "dense_optimizer": "lbfgs"}, r"dense_optimizer='lbfgs' is not one of"),
    ],
)
def test_dlrm_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DLRMRanker(**kwargs)


def test_dlrm_builds_on_meta_device():
    model = DLRMRanker(table_sizes=[10**7, 10**7], embedding_dim=16, embedding_device="meta")
    tables = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    assert tables and all(p.is_meta for p in tables)

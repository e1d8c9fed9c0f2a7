"""Embedding weight decay: one rule (FBGEMM's L2 on the looked-up rows) for fused and data-parallel tables."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from lightning_recsys import EmbeddingOptimizerConfig
from lightning_recsys.parallel.sharding import embedding_optimizer
from lightning_recsys.parallel.sharding.embedding_optimizer import LookedUpRowWiseAdagrad, WeightDecayMode, fbgemm_cpu_applies_l2_decay

LR, EPS, DECAY = 0.1, 1e-8, 0.5


def test_fused_params_carry_fbgemm_l2_decay_mode() -> None:
    params = EmbeddingOptimizerConfig(name="rowwise_adagrad", weight_decay=0.01).fused_params()
    # Without weight_decay_mode FBGEMM's default (NONE) silently drops the decay.
    assert params["weight_decay_mode"] == WeightDecayMode.L2 and params["weight_decay"] == 0.01
    assert params["optimizer"] == EmbOptimType.EXACT_ROWWISE_ADAGRAD
    assert "weight_decay_mode" not in EmbeddingOptimizerConfig(name="rowwise_adagrad").fused_params()


@pytest.mark.parametrize(("name", "kernel"), [("sgd", "EXACT_SGD"), ("adagrad", "EXACT_ADAGRAD"), ("adam", "ADAM")])
def test_weight_decay_is_refused_where_fbgemm_has_no_l2_decay(name: str, kernel: str) -> None:
    with pytest.raises(ValueError, match=rf"name='{name}', weight_decay=0.1\) is not supported: FBGEMM's fused {kernel} kernel"
                       r".*Use name='rowwise_adagrad'"):
        EmbeddingOptimizerConfig(name=name, weight_decay=0.1)  # type: ignore[arg-type]
    EmbeddingOptimizerConfig(name=name, weight_decay=0.0)  # type: ignore[arg-type]


def test_weight_decay_on_cpu_is_refused_for_model_parallel_tables_if_fbgemm_ignores_it(monkeypatch) -> None:
    config = EmbeddingOptimizerConfig(name="rowwise_adagrad", weight_decay=0.1)
    monkeypatch.setattr(embedding_optimizer, "fbgemm_cpu_applies_l2_decay", lambda: False)
    with pytest.raises(ValueError, match=r"weight_decay=0.1\) would be ignored on CPU.*sharding_types=\[.data_parallel.\]"):
        config.check_device("cpu", None)
    with pytest.raises(ValueError, match="would be ignored on CPU"):
        config.check_device("cpu", ["table_wise", "data_parallel"])
    config.check_device("cpu", ["data_parallel"])  # torch applies the rule
    config.check_device("cuda", None)
    monkeypatch.setattr(embedding_optimizer, "fbgemm_cpu_applies_l2_decay", lambda: True)
    config.check_device("cpu", None)


def test_fbgemm_cpu_1_8_kernel_ignores_weight_decay() -> None:
    # The measured fact behind the CPU refusal; a later release that applies it passes the probe.
    if metadata.version("fbgemm-gpu-cpu") != "1.8.0":
        pytest.skip("measured on fbgemm-gpu-cpu 1.8.0")
    assert fbgemm_cpu_applies_l2_decay() is False


def _fbgemm_l2_reference(weight: torch.Tensor, grad: torch.Tensor, total: torch.Tensor, rows: list[int]) -> None:
    """FBGEMM's EXACT_ROWWISE_ADAGRAD with WeightDecayMode.L2 on ``rows``, in place (its kernel template)."""
    g = grad[rows] + DECAY * weight[rows]
    total[rows] += g.pow(2).mean(dim=1, keepdim=True)
    weight[rows] -= LR * g / (total[rows].sqrt() + EPS)


def test_data_parallel_rowwise_adagrad_decays_only_the_looked_up_rows_as_fbgemm_does() -> None:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(6, 4))
    optimizer = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=LR, eps=EPS, weight_decay=DECAY).make_torch_optimizer([param])
    expected, total = param.detach().clone(), torch.zeros(6, 1)
    for rows in ([1, 3, 4], [0, 3], [3]):
        grad = torch.zeros(6, 4)
        grad[rows] = torch.randn(len(rows), 4)
        param.grad = grad.clone()
        optimizer.step()
        _fbgemm_l2_reference(expected, grad, total, rows)
    torch.testing.assert_close(param.detach(), expected)
    torch.testing.assert_close(optimizer.state[param]["sum"], total)
    assert torch.equal(param.detach()[[2, 5]], expected[[2, 5]]) and not total[[2, 5]].any()  # never looked up


def test_without_decay_it_is_torchrecs_rowwise_adagrad_with_the_same_state() -> None:
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(1)
    ours, theirs = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(5, 3))
    theirs.data.copy_(ours.data)
    a, b = LookedUpRowWiseAdagrad([ours], lr=LR, eps=EPS), RowWiseAdagrad([theirs], lr=LR, eps=EPS)
    for _ in range(3):
        grad = torch.randn(5, 3) * (torch.rand(5, 1) > 0.5)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    assert torch.equal(ours.detach(), theirs.detach())
    assert a.state_dict()["state"][0].keys() == b.state_dict()["state"][0].keys() == {"sum", "step"}
    assert torch.equal(a.state[ours]["sum"], b.state[theirs]["sum"])


@pytest.mark.gpu
def test_data_parallel_optimizer_matches_fbgemms_cuda_kernel_with_l2_decay() -> None:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    config = EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=LR, eps=EPS, weight_decay=DECAY)
    fused = {k: v for k, v in config.fused_params().items() if k != "optimizer"}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(6, 4, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)], optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        pooling_mode=PoolingMode.SUM, stochastic_rounding=False, **fused,
    )
    torch.manual_seed(2)
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(torch.randn(6, 4))
    dense = torch.nn.EmbeddingBag(6, 4, mode="sum").cuda()
    dense.weight.data.copy_(tbe.split_embedding_weights()[0])
    optimizer = config.make_torch_optimizer([dense.weight])
    for indices in ([1, 3, 3, 4], [0, 3, 5, 5], [2, 2, 3, 1]):
        ids, offsets = torch.tensor(indices).cuda(), torch.tensor([0, 2, 4]).cuda()
        upstream = torch.randn(2, 4).cuda()
        tbe(ids, offsets).backward(upstream)
        dense.weight.grad = None
        dense(ids, offsets[:-1]).backward(upstream)
        optimizer.step()
    torch.testing.assert_close(dense.weight.detach(), tbe.split_embedding_weights()[0], rtol=1e-5, atol=1e-6)


def test_adam_on_cpu_trains_when_every_table_is_constrained_to_data_parallel() -> None:
    # The CPU check read only PlanningConfig(sharding_types), so a model made all data-parallel through
    # TableConstraints was refused ("not supported by FBGEMM's fused CPU kernels") though FBGEMM runs nothing.
    from lightning.pytorch import Trainer

    from lightning_recsys import PlanningConfig, TableConstraints, TwoDRecStrategy
    from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
    from lightning_recsys.models import DLRMRanker

    config = SyntheticClickLogConfig(table_sizes=[20, 30], num_dense_features=2, global_batch_size=8, train_batches=2, val_batches=1)
    model = DLRMRanker(table_sizes=config.table_sizes, num_dense_features=2, embedding_dim=4, dense_arch_layer_sizes=[4])
    every_table = {f"t_sparse_{i}": TableConstraints(sharding_types=["data_parallel"]) for i in range(2)}
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="adam"), planning=PlanningConfig(table_constraints=every_table), process_group_timeout=30
    )
    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=2, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(config))
    assert trainer.global_step == 2
    assert {p["sharding_type"] for p in _plan_rows(strategy)} == {"data_parallel"}
    # One table left free may be model-parallel: still refused before anything is built.
    partly = PlanningConfig(table_constraints={"t_sparse_0": TableConstraints(sharding_types=["data_parallel"])})
    from lightning_recsys.strategies.validation import check_device_support

    with pytest.raises(ValueError, match=r"name='adam'\) is not supported by FBGEMM's fused CPU kernels"):
        check_device_support("cpu", None, EmbeddingOptimizerConfig(name="adam"), partly, two_d=False, table_names=["t_sparse_0", "t_sparse_1"])


def _plan_rows(strategy) -> list[dict]:
    from lightning_recsys.planner import plan_rows

    return plan_rows(strategy.sharded_model.plan)

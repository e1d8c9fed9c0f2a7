"""TwoDRecStrategy with real processes (gloo): sharded training equals unsharded training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer

from lightning_recsys import EmbeddingOptimizerConfig, TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogConfig, SyntheticClickLogDataModule, slice_batch
from lightning_recsys.models import DLRMRanker
from lightning_recsys.parallel.sharded_model import local_shards
from lightning_recsys.planner import plan_rows
from multiprocess import run_ranks

WORLD_SIZE = 2
STEPS = 3
EMBEDDING_LR = 0.3
DENSE_LR = 0.1
CONFIG = SyntheticClickLogConfig(
    table_sizes=[40, 64, 24],
    num_dense_features=4,
    pooling_factors=[2.0, 3.0, 1.0],
    global_batch_size=16,
    train_batches=STEPS,
    val_batches=1,
    seed=7,
)


def _model() -> DLRMRanker:
    torch.manual_seed(1234)
    return DLRMRanker(
        table_sizes=CONFIG.table_sizes,
        num_dense_features=CONFIG.num_dense_features,
        embedding_dim=8,
        dense_arch_layer_sizes=[8, 8],
        over_arch_layer_sizes=[8, 1],
        dense_optimizer="sgd",
        dense_lr=DENSE_LR,
    )


def _train_unsharded() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = _model()
    embedding = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    optimizer = torch.optim.SGD([{"params": dense, "lr": DENSE_LR}, {"params": embedding, "lr": EMBEDDING_LR}])
    log = SyntheticClickLog(CONFIG)
    for step in range(STEPS):
        batch = log.global_batch("train", step)
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(model(batch), batch.labels).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        predictions = model(log.global_batch("val", 0))
    return {k: v.clone() for k, v in model.state_dict().items()}, predictions


def _train_sharded(rank: int, world_size: int, sharding_type: str, accelerator: str = "cpu") -> dict:
    model = _model()
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=EMBEDDING_LR),
        sharding_types=[sharding_type],
        process_group_timeout=60,
    )
    trainer = Trainer(
        accelerator=accelerator,
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=SyntheticClickLogDataModule(CONFIG))
    local = CONFIG.global_batch_size // world_size
    model.eval()
    with torch.no_grad():
        eval_batch = slice_batch(SyntheticClickLog(CONFIG).global_batch("val", 0), rank * local, (rank + 1) * local)
        predictions = model(eval_batch.to(strategy.root_device)).cpu()
    collectives = {
        "sum": strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item(),
        "mean": strategy.reduce(torch.tensor(float(rank + 1))).item(),
        "broadcast": strategy.broadcast({"from": rank}, src=world_size - 1),
        "all_gather": strategy.all_gather(torch.tensor([rank])).reshape(-1).tolist(),
    }
    strategy.barrier()
    return {
        "collectives": collectives,
        "shards": {k: [(o, t.cpu()) for o, t in v] for k, v in local_shards(model.dlrm).items()},
        "predictions": predictions,
        "plan": plan_rows(strategy.sharded_model.plan),
        "steps": trainer.global_step,
    }


def _assemble(pieces_by_rank: list[dict], key: str, like: torch.Tensor) -> torch.Tensor:
    full = torch.full_like(like, float("nan"))
    for pieces in pieces_by_rank:
        for offsets, tensor in pieces[key]:
            full[tuple(slice(o, o + s) for o, s in zip(offsets, tensor.shape))] = tensor
    assert not torch.isnan(full).any(), f"{key}: the ranks' shards do not cover the whole table"
    return full


def _check_against_unsharded(sharding_type: str, world_size: int, accelerator: str, **tolerances: float) -> None:
    expected_state, expected_predictions = _train_unsharded()
    results = run_ranks(_train_sharded, world_size, sharding_type, accelerator, timeout=240)

    assert all(r["steps"] == STEPS for r in results)
    for r in results:
        assert r["collectives"]["sum"] == world_size * (world_size + 1) / 2
        assert r["collectives"]["mean"] == (world_size + 1) / 2
        assert r["collectives"]["broadcast"] == {"from": world_size - 1}
        assert r["collectives"]["all_gather"] == list(range(world_size))
    assert {row["sharding_type"] for row in results[0]["plan"]} == {sharding_type}
    shards = [r["shards"] for r in results]
    for key, expected in expected_state.items():
        if not key.startswith("dlrm."):
            continue
        local_key = key.removeprefix("dlrm.")
        assembled = _assemble(shards, local_key, expected)
        torch.testing.assert_close(assembled, expected, msg=lambda m: f"{key}: {m}", **tolerances)
    torch.testing.assert_close(torch.cat([r["predictions"] for r in results]), expected_predictions, **tolerances)
    # Training must have moved the tables, or the comparison above proves nothing.
    initial = _model().state_dict()
    table_key = "dlrm.sparse_arch.embedding_bag_collection.embedding_bags.t_sparse_0.weight"
    assert not torch.allclose(initial[table_key], expected_state[table_key])


@pytest.mark.parametrize(
    "sharding_type",
    ["table_wise", "row_wise", "column_wise", "data_parallel", "table_row_wise", "table_column_wise"],
)
def test_sharded_training_matches_unsharded(sharding_type: str) -> None:
    _check_against_unsharded(sharding_type, WORLD_SIZE, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise"])
def test_sharded_training_matches_unsharded_on_cuda_nccl(sharding_type: str) -> None:
    # CUDA kernels sum in another order than the CPU reference, hence the looser tolerance.
    _check_against_unsharded(sharding_type, min(2, torch.cuda.device_count()), "gpu", rtol=1e-4, atol=1e-5)

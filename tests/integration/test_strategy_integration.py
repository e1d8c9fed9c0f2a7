"""TwoDRecStrategy with real processes (gloo): sharded training equals unsharded training."""

from __future__ import annotations

import pytest
import torch
from lightning_recsys.testing.oracle.click import STEPS, assert_matches, fit_sharded, sgd_strategy, shards_of, train_unsharded
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys.planner import plan_rows

WORLD_SIZE = 2


def _train_sharded(rank: int, world_size: int, sharding_type: str, accelerator: str = "cpu") -> dict:
    strategy = sgd_strategy(sharding_types=[sharding_type])
    model, trainer, predictions = fit_sharded(rank, world_size, strategy, accelerator=accelerator)
    collectives = {
        "sum": strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item(),
        "mean": strategy.reduce(torch.tensor(float(rank + 1))).item(),
        "broadcast": strategy.broadcast({"from": rank}, src=world_size - 1),
        "all_gather": strategy.all_gather(torch.tensor([rank])).reshape(-1).tolist(),
    }
    strategy.barrier()
    return {
        "collectives": collectives,
        "shards": shards_of(model),
        "predictions": predictions,
        "plan": plan_rows(strategy.sharded_model.plan),
        "steps": trainer.global_step,
    }


def _check_against_unsharded(sharding_type: str, world_size: int, accelerator: str, **tolerances: float) -> None:
    expected_state, expected_predictions = train_unsharded()
    results = run_ranks(_train_sharded, world_size, sharding_type, accelerator, timeout=240)

    assert all(r["steps"] == STEPS for r in results)
    for r in results:
        assert r["collectives"]["sum"] == world_size * (world_size + 1) / 2
        assert r["collectives"]["mean"] == (world_size + 1) / 2
        assert r["collectives"]["broadcast"] == {"from": world_size - 1}
        assert r["collectives"]["all_gather"] == list(range(world_size))
    assert {row["sharding_type"] for row in results[0]["plan"]} == {sharding_type}
    shards, predictions = [r["shards"] for r in results], [r["predictions"] for r in results]
    assert_matches(shards, predictions, expected_state, expected_predictions, **tolerances)


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


def _replica_sync_warnings(rank: int, world_size: int, replica_sync: object) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_sharded(rank, world_size, sgd_strategy(replica_sync=replica_sync))
    return [str(w.message) for w in caught if "replica_sync=" in str(w.message)]


def test_a_replica_sync_config_in_a_1d_run_is_said_to_have_no_effect() -> None:
    # A ReplicaSyncConfig given to a 1D run (one replica) was ignored without a word.
    from lightning_recsys import ReplicaSyncConfig

    (warned,) = run_ranks(_replica_sync_warnings, 2, ReplicaSyncConfig(every_n_steps=4), timeout=120)[0]
    assert "has no effect: this run is 1D (sharding_group_size 2 = world size 2, one replica)" in warned
    assert run_ranks(_replica_sync_warnings, 2, None, timeout=120)[0] == []  # the default says nothing

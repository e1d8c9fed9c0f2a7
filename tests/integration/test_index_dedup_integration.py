"""Index dedup on and off give the unsharded model's results (sequence ranker, TW and RW); it needs CUDA.

FBGEMM's ``jagged_unique_indices`` (what TorchRec's dedup runs) has no CPU kernel in fbgemm-gpu-cpu
1.8.0, so on CPU the option is an error (tests/unit/test_index_dedup.py) and this test is skipped.
"""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks
from oracle import assemble
from sequence_oracle import ITEM_KEY, SequenceLogConfig, fit_sharded, global_batch, sgd_strategy, table_shards, train_unsharded

from lightning_recsys import QCommsConfig



def _fit_on_cpu(rank: int, world_size: int) -> str:
    strategy = sgd_strategy(qcomms=QCommsConfig(index_dedup=True))
    try:
        fit_sharded(rank, world_size, strategy)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_dedup_without_fbgemms_kernel_raises_on_every_rank_before_training() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU build's error; with CUDA the option runs (test below)")
    messages = run_ranks(_fit_on_cpu, 2, timeout=240)
    assert all("index_dedup=True" in m and "jagged_unique_indices" in m for m in messages), messages


def _fit(rank: int, world_size: int, sharding_type: str, dedup: bool) -> dict:
    strategy = sgd_strategy(sharding_types=[sharding_type], qcomms=QCommsConfig(index_dedup=dedup))
    model, _, predictions = fit_sharded(rank, world_size, strategy, accelerator="gpu")
    return {"predictions": predictions, "shards": table_shards(model)}


@pytest.mark.gpu
@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_dedup_on_and_off_train_as_the_unsharded_model(sharding_type: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("index dedup runs FBGEMM's jagged_unique_indices, which has no CPU kernel (fbgemm-gpu-cpu 1.8.0)")
    actions = global_batch(SequenceLogConfig(), "train", 0).sparse["action"].values()
    assert actions.unique().numel() < actions.numel()  # repeated ids: dedup has something to remove
    expected_state, expected_predictions = train_unsharded()
    world_size = min(2, torch.cuda.device_count())
    for dedup in (False, True):
        results = run_ranks(_fit, world_size, sharding_type, dedup, timeout=300)
        torch.testing.assert_close(torch.cat([r["predictions"] for r in results]), expected_predictions, rtol=1e-4, atol=1e-5)
        items = assemble([r["shards"] for r in results], ITEM_KEY, expected_state[ITEM_KEY])
        torch.testing.assert_close(items, expected_state[ITEM_KEY], rtol=1e-4, atol=1e-5)

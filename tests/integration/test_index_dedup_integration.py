"""Index dedup on and off give the unsharded model's results (sequence ranker with repeated ids, TW and RW).

On CPU, dedup runs our kernel for FBGEMM's ``jagged_unique_indices`` (fbgemm-gpu-cpu 1.8.0 has none;
``lightning_recsys.parallel.sharding.index_dedup``); the GPU variant runs FBGEMM's CUDA kernel.
"""

from __future__ import annotations

import pytest
import torch
from lightning_recsys.testing.oracle import assemble
from lightning_recsys.testing.oracle.sequence import ITEM_KEY, SequenceLogConfig, fit_sharded, global_batch, sgd_strategy, table_shards, train_unsharded
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import QCommsConfig

WORLD_SIZE = 2


def _fit(rank: int, world_size: int, sharding_type: str, dedup: bool, accelerator: str) -> dict:
    strategy = sgd_strategy(sharding_types=[sharding_type], qcomms=QCommsConfig(index_dedup=dedup))
    model, _, predictions = fit_sharded(rank, world_size, strategy, accelerator=accelerator, steps=1)
    return {
        "predictions": predictions,
        "shards": table_shards(model),
        "bytes": strategy.comm_accounting.bytes_by(purpose="embeddings", op="all_to_all")[0],
    }


def _check_dedup_matches_unsharded(sharding_type: str, accelerator: str, world_size: int) -> None:
    actions = global_batch(SequenceLogConfig(), "train", 0).sparse["history_item_id"].values()
    assert actions.unique().numel() < actions.numel()  # repeated ids: dedup has something to remove
    expected_state, expected_predictions = train_unsharded(steps=1)
    sent = {}
    for dedup in (False, True):
        results = run_ranks(_fit, world_size, sharding_type, dedup, accelerator, timeout=300)
        torch.testing.assert_close(torch.cat([r["predictions"] for r in results]), expected_predictions, rtol=1e-4, atol=1e-5)
        items = assemble([r["shards"] for r in results], ITEM_KEY, expected_state[ITEM_KEY])
        torch.testing.assert_close(items, expected_state[ITEM_KEY], rtol=1e-4, atol=1e-5)
        sent[dedup] = sum(r["bytes"] for r in results)
    assert 0 < sent[True] < sent[False], sent  # the accounting sees the deduped all-to-all's smaller payload


@pytest.mark.slow
@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_dedup_on_and_off_train_as_the_unsharded_model_on_cpu(sharding_type: str) -> None:
    _check_dedup_matches_unsharded(sharding_type, "cpu", WORLD_SIZE)


@pytest.mark.gpu
@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_dedup_on_and_off_train_as_the_unsharded_model_on_gpu(sharding_type: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("the GPU variant runs FBGEMM's CUDA jagged_unique_indices; this machine has no CUDA device")
    _check_dedup_matches_unsharded(sharding_type, "gpu", min(WORLD_SIZE, torch.cuda.device_count()))

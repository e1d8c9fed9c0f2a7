"""SequenceRanker under TwoDRecStrategy with real processes (gloo): equivalence, QComms, 2D, checkpoints."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback
from multiprocess import run_ranks
from oracle import assemble
from sequence_oracle import ITEM_KEY, STEPS, fit_sharded, make_model, sgd_strategy, table_shards, train_unsharded

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def oracle():
    return train_unsharded()


class _RecordPipeline(Callback):
    """What the sparse-dist pipeline did while training (the strategy drops it at teardown)."""

    def __init__(self) -> None:
        self.pipelined: set[str] = set()
        self.disabled_reason: str | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pipeline = trainer.strategy._input_pipeline
        if pipeline is not None:
            self.pipelined |= set(pipeline.pipelined_modules)
            self.disabled_reason = pipeline.disabled_reason


def _fit(rank: int, world_size: int, sharding_type: str) -> dict:
    strategy = sgd_strategy(sharding_types=[sharding_type])
    record = _RecordPipeline()
    model, trainer, predictions = fit_sharded(rank, world_size, strategy, callbacks=[record])
    assert trainer.global_step == STEPS
    return {
        "shards": table_shards(model),
        "dense": {k: v.clone() for k, v in model.state_dict().items() if "embeddings." not in k and "metrics" not in k},
        "predictions": predictions,
        "pipeline_off": record.disabled_reason,
        "pipelined": sorted(record.pipelined),
    }


@pytest.mark.slow
@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise"])
def test_sharded_training_equals_unsharded(sharding_type, oracle):
    expected_state, expected_predictions = oracle
    results = run_ranks(_fit, WORLD_SIZE, sharding_type, timeout=300)
    for key, expected in expected_state.items():
        if "embeddings." in key:
            torch.testing.assert_close(assemble([r["shards"] for r in results], key, expected), expected, msg=lambda m: f"{key}: {m}")
        else:
            for result in results:
                torch.testing.assert_close(result["dense"][key], expected, msg=lambda m: f"{key}: {m}")
    torch.testing.assert_close(torch.cat([r["predictions"] for r in results]), expected_predictions)
    assert not torch.allclose(make_model().state_dict()[ITEM_KEY], expected_state[ITEM_KEY])  # training moved the items
    if sharding_type == "column_wise":
        assert any(offsets[1] > 0 for r in results for pieces in r["shards"].values() for offsets, _ in pieces)
    for result in results:  # the sparse-dist pipeline kept both collections pipelined
        assert result["pipeline_off"] is None and len(result["pipelined"]) == 2, result

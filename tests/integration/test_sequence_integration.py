"""SequenceRanker under TwoDRecStrategy with real processes (gloo): equivalence, QComms, 2D, checkpoints."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from multiprocess import run_ranks
from oracle import assemble
from sequence_oracle import (
    ACTION_KEY, ITEM_KEY, STEPS, SequenceDataModule, SequenceLogConfig, global_batch, fit_sharded, local_predictions, make_model, sgd_strategy, table_shards,
    train_unsharded,
)

from lightning_recsys.models import SequenceRanker

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


PRECISIONS = ["bf16", "fp8", "int8"]
# Dim 16 (column_wise: two 8-wide shards): fp8/int8 scale blocks of 8 or 16 values, where they send fewer
# bytes than bf16 (at blocks of 4 they run as bf16).
QCOMMS_DIM = 16


def _qcomms_model() -> SequenceRanker:
    return make_model(embedding_dim=QCOMMS_DIM)


def _quantized_one_direction(rank: int, world_size: int, sharding_type: str) -> dict:
    """Per precision: the untrained model's predictions with only the forward quantized, and the
    table updates of one training step with only the backward (the gradients) quantized."""
    from lightning_recsys import QCommsConfig

    out: dict = {}
    for precision in PRECISIONS:
        strategy = sgd_strategy(sharding_types=[sharding_type], column_width=QCOMMS_DIM // 2, qcomms=QCommsConfig(forward=precision))
        model = _qcomms_model()
        Trainer(accelerator="cpu", devices=world_size, strategy=strategy, logger=False, enable_progress_bar=False,
                enable_model_summary=False).validate(model, datamodule=SequenceDataModule(), verbose=False)
        forward = {"predictions": local_predictions(model, rank, world_size), "effective": strategy.effective_qcomms.precisions}
        strategy = sgd_strategy(sharding_types=[sharding_type], column_width=QCOMMS_DIM // 2, qcomms=QCommsConfig(backward=precision))
        model, _, _ = fit_sharded(rank, world_size, strategy, steps=1, model_factory=_qcomms_model)
        backward = {"shards": table_shards(model), "effective": strategy.effective_qcomms.precisions}
        out[precision] = {"forward": forward, "backward": backward}
    return out


# A value rounded to the nearest of the format: bf16 keeps 8 significant bits, fp8 e4m3 (forward) 4 and
# e5m2 (backward) 3; int8 rounds to 1/127 of its block's largest magnitude. Bounds: twice that, relative
# to the largest magnitude (a sum of rounded terms, and the scale applied in fp32).
FORWARD_BOUND = {"bf16": 2**-7, "fp8": 2**-3, "int8": 2**-6}
BACKWARD_BOUND = {"bf16": 2**-7, "fp8": 2**-2, "int8": 2**-6}


@pytest.mark.slow
@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise", "column_wise"])
def test_quantized_sequence_all_to_all_errors_stay_within_each_formats_bound_forward_and_backward(sharding_type):
    _, untrained_predictions = train_unsharded(steps=0, embedding_dim=QCOMMS_DIM)
    trained_state, _ = train_unsharded(steps=1, embedding_dim=QCOMMS_DIM)
    initial = _qcomms_model().state_dict()
    results = run_ranks(_quantized_one_direction, WORLD_SIZE, sharding_type, timeout=400)
    for precision in PRECISIONS:
        forward = [r[precision]["forward"] for r in results]
        assert forward[0]["effective"]["sequence_all_to_all"] == (FORMAT[precision][0], "fp32"), forward[0]["effective"]
        predictions = torch.cat([f["predictions"] for f in forward])
        bound = FORWARD_BOUND[precision] * float(untrained_predictions.abs().max())
        torch.testing.assert_close(predictions, untrained_predictions, rtol=0, atol=bound, msg=lambda m: f"{precision} forward: {m}")
        assert not torch.equal(predictions, untrained_predictions), f"{precision}: the forward was not quantized"

        backward = [r[precision]["backward"] for r in results]
        assert backward[0]["effective"]["sequence_all_to_all"] == ("fp32", FORMAT[precision][1]), backward[0]["effective"]
        for key in (ITEM_KEY, ACTION_KEY):
            expected_update = trained_state[key] - initial[key]
            update = assemble([b["shards"] for b in backward], key, initial[key]) - initial[key]
            bound = BACKWARD_BOUND[precision] * float(expected_update.abs().max())
            torch.testing.assert_close(update, expected_update, rtol=0, atol=bound, msg=lambda m: f"{precision} backward {key}: {m}")
            assert not torch.equal(update, expected_update), f"{precision}: the gradients of {key} were not quantized"


FORMAT = {"bf16": ("bf16", "bf16"), "fp8": ("fp8_e4m3", "fp8_e5m2"), "int8": ("int8", "int8")}


# (forward, backward) precision -> bytes per value on the wire; fp8/int8 carry a 4-byte scale per block of 16 values.
WIRE_CASES = {
    ("fp32", "fp32"): (4, 4),
    ("bf16", "bf16"): (2, 2),
    ("fp8", "fp8"): (1.25, 1.25),
    ("int8", "bf16"): (1.25, 2),
    ("fp8", "fp32"): (1.25, 4),
    ("fp32", "fp8"): (4, 1.25),
}
WIRE_DIM = 16


def _sequence_bytes_per_case(rank: int, world_size: int) -> dict:
    """Embedding all-to-all bytes of the last training step of a model whose only tables are sequence tables."""
    from lightning_recsys import QCommsConfig

    out = {}
    for forward, backward in WIRE_CASES:
        strategy = sgd_strategy(sharding_types=["table_wise"], qcomms=QCommsConfig(forward=forward, backward=backward))
        fit_sharded(rank, world_size, strategy, config=SequenceLogConfig(with_context=False), model_factory=lambda: make_model(
            context_feature_names=None, context_table_sizes=None, embedding_dim=WIRE_DIM, num_heads=3))
        out[(forward, backward)] = {
            "bytes": strategy.comm_accounting.bytes_by(purpose="embeddings", op="all_to_all")[0],
            "effective": strategy.effective_qcomms.precisions["sequence_all_to_all"],
        }
    return out


@pytest.mark.slow
def test_sequence_all_to_all_sends_the_bytes_per_value_of_its_precision_forward_and_backward():
    results = run_ranks(_sequence_bytes_per_case, WORLD_SIZE, timeout=400)
    # The last step's batch: every history item and action and the candidate is one looked-up row,
    # sent once forward (owner -> example's rank) and its gradient once backward, summed over the ranks.
    sparse = global_batch(SequenceLogConfig(with_context=False), "train", STEPS - 1).sparse
    rows = sum(sparse[name].values().numel() for name in ("history_item_id", "history_action", "candidate_item_id"))
    for (forward, backward), (forward_bytes, backward_bytes) in WIRE_CASES.items():
        assert results[0][(forward, backward)]["effective"][0].startswith(forward), results[0][(forward, backward)]
        measured = sum(r[(forward, backward)]["bytes"] for r in results)
        assert measured == rows * WIRE_DIM * (forward_bytes + backward_bytes), (forward, backward, measured, rows)

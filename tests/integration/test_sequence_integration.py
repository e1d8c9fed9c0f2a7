"""SequenceRanker under TwoDRecStrategy with real processes (gloo): equivalence, QComms, 2D, checkpoints."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_recsys.testing.oracle import RecordPipeline, assemble
from lightning_recsys.testing.oracle.sequence import (
    ACTION_KEY, ITEM_KEY, STEPS, SequenceDataModule, SequenceLogConfig, global_batch, fit_sharded, local_predictions, make_model, sgd_strategy, table_shards,
    train_unsharded,
)
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import EmbeddingOptimizerConfig, PlanningConfig, TableConstraints, TwoDRecStrategy
from lightning_recsys.models import SequenceRanker

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def oracle():
    return train_unsharded()


def _fit(rank: int, world_size: int, sharding_type: str) -> dict:
    strategy = sgd_strategy(sharding_types=[sharding_type])
    record = RecordPipeline()
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
        model, _, _ = fit_sharded(rank, world_size, strategy, steps=1, model=_qcomms_model())
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
        largest = float((predictions - untrained_predictions).abs().max() / untrained_predictions.abs().max())
        print(f"{sharding_type} {precision} forward: largest |error| / largest |prediction| = {largest:.2e} (bound {FORWARD_BOUND[precision]:.2e})")
        torch.testing.assert_close(predictions, untrained_predictions, rtol=0, atol=bound, msg=lambda m: f"{precision} forward: {m}")
        assert not torch.equal(predictions, untrained_predictions), f"{precision}: the forward was not quantized"

        backward = [r[precision]["backward"] for r in results]
        assert backward[0]["effective"]["sequence_all_to_all"] == ("fp32", FORMAT[precision][1]), backward[0]["effective"]
        for key in (ITEM_KEY, ACTION_KEY):
            expected_update = trained_state[key] - initial[key]
            update = assemble([b["shards"] for b in backward], key, initial[key]) - initial[key]
            bound = BACKWARD_BOUND[precision] * float(expected_update.abs().max())
            largest = float((update - expected_update).abs().max() / expected_update.abs().max())
            print(f"{sharding_type} {precision} backward {key.split('.')[-2]}: largest |error| / largest |update| = {largest:.2e}")
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
        fit_sharded(rank, world_size, strategy, config=SequenceLogConfig(with_context=False), model=make_model(
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


# ----------------------------------------------------------------- checkpoints: save, reshard load, evaluate, export
RESHARD_CONFIG = SequenceLogConfig(global_batch_size=12, train_batches=STEPS, val_batches=1, test_batches=2)  # 2 and 3 ranks


def _checkpoint_strategy(sharding_types: list[str]) -> TwoDRecStrategy:
    return TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1),
        planning=PlanningConfig(sharding_types=sharding_types, table_constraints={
            t: TableConstraints(sharding_types=sharding_types, min_partition=4) for t in ("item", "action", "t_user_id", "t_genre")
        } if sharding_types == ["column_wise"] else {}),
        process_group_timeout=60,
    )


def _evaluation_trainer(world_size: int, strategy: TwoDRecStrategy, **kwargs) -> Trainer:
    return Trainer(accelerator="cpu", devices=world_size, strategy=strategy, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, **kwargs)


def _fit_and_save(rank: int, world_size: int, ckpt_dir: str) -> dict:
    strategy = _checkpoint_strategy(["table_wise"])
    trainer = _evaluation_trainer(world_size, strategy, max_epochs=1, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, filename="fitted")])
    model = make_model(embedding_device="meta", seed=None)  # tables initialized by TorchRec on each rank's shards
    data = SequenceDataModule(RESHARD_CONFIG)
    trainer.fit(model, datamodule=data)
    return {
        "tables": table_shards(model),
        "val_auc": trainer.validate(model, datamodule=data, verbose=False)[0]["val/auc"],
        "predictions": torch.cat(trainer.predict(model, datamodule=data)),
    }


def _evaluate_resharded(rank: int, world_size: int, ckpt_path: str, sharding_type: str) -> dict:
    data = SequenceDataModule(RESHARD_CONFIG)
    out: dict = {}
    for fn in ("validate", "test", "predict"):
        model = make_model(embedding_device="meta", seed=None)
        out[fn] = getattr(_evaluation_trainer(world_size, _checkpoint_strategy([sharding_type])), fn)(model, datamodule=data, ckpt_path=ckpt_path)
    out["tables"] = table_shards(model)
    out["predictions"] = torch.cat(out.pop("predict"))
    return out


def _in_example_order(per_rank: list[torch.Tensor], local: int) -> torch.Tensor:
    """Per-rank predictions (each rank's slice of every batch, batch after batch) in global example order."""
    batches = per_rank[0].numel() // local
    return torch.cat([p[b * local : (b + 1) * local] for b in range(batches) for p in per_rank])


@pytest.mark.slow
def test_a_checkpoint_reshards_onto_other_ranks_and_types_and_exports_to_one_unsharded_model(tmp_path):
    saved = run_ranks(_fit_and_save, 2, str(tmp_path), timeout=300)
    checkpoint = str(tmp_path / "fitted.ckpt")
    shapes = make_model().state_dict()
    tables = {key: assemble([r["tables"] for r in saved], key, shapes[key]) for key in saved[0]["tables"]}
    assert set(tables) == {ITEM_KEY, ACTION_KEY, "context_embeddings.embedding_bags.t_user_id.weight",
                           "context_embeddings.embedding_bags.t_genre.weight"}
    saved_predictions = _in_example_order([r["predictions"] for r in saved], 6)  # 2 test batches of 12: 6 per rank
    for sharding_type in ("row_wise", "column_wise"):
        loaded = run_ranks(_evaluate_resharded, 3, checkpoint, sharding_type, timeout=300)
        for key, expected in tables.items():
            assert torch.equal(assemble([r["tables"] for r in loaded], key, expected), expected), f"{sharding_type}: {key}"
        assert loaded[0]["validate"][0]["val/auc"] == pytest.approx(saved[0]["val_auc"], abs=1e-6)
        assert "test/auc" in loaded[0]["test"][0]
        torch.testing.assert_close(_in_example_order([r["predictions"] for r in loaded], 4), saved_predictions)

    # Export: one unsharded model in this process, from the same directory, predicts as the sharded ones did.
    exported = SequenceRanker.load_from_checkpoint(checkpoint).eval()
    assert not any(p.is_meta for p in exported.parameters())
    for key, expected in tables.items():
        assert torch.equal(exported.state_dict()[key], expected), key
    with torch.no_grad():
        predictions = torch.cat([torch.sigmoid(exported(global_batch(RESHARD_CONFIG, "test", i))) for i in range(2)])
    torch.testing.assert_close(predictions, saved_predictions)

    # And as safetensors (weights only, no pickle) into a model built from its arguments.
    from safetensors.torch import load_file

    from lightning_recsys.checkpoint.safetensors_export import export_safetensors

    rebuilt = make_model(seed=0)
    rebuilt.load_state_dict(load_file(export_safetensors(checkpoint, tmp_path / "fitted.safetensors")))
    with torch.no_grad():
        rebuilt_predictions = torch.cat([torch.sigmoid(rebuilt.eval()(global_batch(RESHARD_CONFIG, "test", i))) for i in range(2)])
    torch.testing.assert_close(rebuilt_predictions, saved_predictions)


# ----------------------------------------------------------------- bad input on one rank
class _BadOnRank1(SequenceDataModule):
    """Rank 1's second training batch is broken: an out-of-range history id, or an action missing."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def _dataset(self, split: str, rank: int, world_size: int):
        return _Broken(super()._dataset(split, rank, world_size), self.kind if split == "train" and rank == 1 else None)


class _Broken(torch.utils.data.IterableDataset):
    def __init__(self, dataset, kind: str | None) -> None:
        self.dataset, self.kind = dataset, kind

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self):
        for index, batch in enumerate(self.dataset):
            yield _broken(batch, self.kind) if self.kind is not None and index == 1 else batch


def _broken(batch, kind: str):
    from lightning_recsys.data import RecBatch
    from torchrec import JaggedTensor, KeyedJaggedTensor

    features = batch.sparse.to_dict()
    history = features["history_item_id"]
    if kind == "out_of_range":
        values = history.values().clone()
        values[-1] = 48  # the item table has 48 rows
        features["history_item_id"] = JaggedTensor(values=values, lengths=history.lengths())
    else:  # the last example with a history loses its newest action
        actions = features["history_action"]
        lengths = actions.lengths().clone()
        lengths[int(torch.nonzero(lengths)[-1])] -= 1
        features["history_action"] = JaggedTensor(values=actions.values()[:-1], lengths=lengths)
    return RecBatch(batch.dense, KeyedJaggedTensor.from_jt_dict(features), batch.labels)


def _fit_bad(rank: int, world_size: int, kind: str) -> str:
    from lightning_recsys.parallel.input.input_guard import InvalidInputError

    trainer = Trainer(accelerator="cpu", devices=world_size, strategy=sgd_strategy(sharding_types=["row_wise"]), max_steps=STEPS,
                      limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(make_model(), datamodule=_BadOnRank1(kind))
    except InvalidInputError as error:
        return f"step {trainer.global_step}: {error}"
    return "no error"


@pytest.mark.slow
def test_bad_sequence_input_on_one_rank_raises_on_every_rank_naming_the_feature():
    for kind, expected in {
        "out_of_range": ("rank 1: batch 1: feature 'history_item_id' has id 48 at example", "but table 'item' has 48 rows"),
        "misaligned": ("rank 1: batch 1: features 'history_item_id' and 'history_action' must have the same length in every example",),
    }.items():
        for message in run_ranks(_fit_bad, WORLD_SIZE, kind, timeout=300):  # both ranks stop after step 1, with rank 1's problem
            assert message.startswith("step 1: ") and all(e in message for e in expected), (kind, message)


# ----------------------------------------------------------------- planning on profiled sequence batches
def _fit_balanced_profiled(rank: int, world_size: int) -> dict:
    strategy = sgd_strategy(planning=PlanningConfig(planner="balanced", profile_batches=2))
    _, trainer, _ = fit_sharded(rank, world_size, strategy, steps=2)
    report = strategy.plan_report
    tables = {} if report is None else {t.name: (t.sharding_type, t.lookups_per_example, t.stats_source) for t in report.tables}
    return {"steps": trainer.global_step, "tables": tables}


@pytest.mark.slow
def test_the_balanced_planner_profiles_the_sequence_tables_and_never_makes_them_data_parallel():
    results = run_ranks(_fit_balanced_profiled, WORLD_SIZE, timeout=300)
    assert [r["steps"] for r in results] == [2, 2]
    tables = results[0]["tables"]  # the report is rank 0's
    # Rank 0 profiles its own slice (the first 8 examples) of the first 2 batches.
    histories = torch.cat([global_batch(SequenceLogConfig(), "train", i).sparse["history_item_id"].lengths()[:8] for i in range(2)])
    mean_history = float(histories.float().mean())
    # The item table serves the history and the candidate: its lookups per example are both.
    assert tables["item"][1] == pytest.approx(mean_history + 1) and tables["action"][1] == pytest.approx(mean_history)
    assert {t[2] for t in tables.values()} != {"assumed"}, tables
    assert tables["item"][0] != "data_parallel" and tables["action"][0] != "data_parallel", tables


# ----------------------------------------------------------------- CUDA (skipped without a GPU)
def _fit_on_cuda(rank: int, world_size: int, qcomms: str) -> dict:
    strategy = sgd_strategy(sharding_types=["table_wise"], qcomms=qcomms)
    model, _, predictions = fit_sharded(rank, world_size, strategy, accelerator="gpu", model=_qcomms_model())
    return {"predictions": predictions, "shards": table_shards(model), "effective": strategy.effective_qcomms.describe()}


@pytest.mark.gpu
@pytest.mark.parametrize("qcomms", ["fp32", "fp8"])
def test_sequence_ranker_on_cuda_trains_as_the_unsharded_cpu_model(qcomms):
    # FBGEMM's CUDA kernels (and, for fp8, its fused rowwise codec where it applies) against the CPU reference.
    world_size = min(2, torch.cuda.device_count())
    expected_state, expected_predictions = train_unsharded(embedding_dim=QCOMMS_DIM)
    results = run_ranks(_fit_on_cuda, world_size, qcomms, timeout=300)
    rtol = 1e-4 if qcomms == "fp32" else RTOL_AFTER_TRAINING_FP8
    scale = float(expected_predictions.abs().max())
    torch.testing.assert_close(torch.cat([r["predictions"] for r in results]), expected_predictions, rtol=rtol, atol=rtol * scale)
    items = assemble([r["shards"] for r in results], ITEM_KEY, expected_state[ITEM_KEY])
    torch.testing.assert_close(items, expected_state[ITEM_KEY], rtol=rtol, atol=rtol * float(expected_state[ITEM_KEY].abs().max()))


# fp8 forward and backward over 3 SGD steps: max-pool and ReLU route the gradients by the quantized forward, so the
# trajectories part more than one rounding (a loose end-to-end bound; the per-direction bounds are tested above).
RTOL_AFTER_TRAINING_FP8 = 0.25

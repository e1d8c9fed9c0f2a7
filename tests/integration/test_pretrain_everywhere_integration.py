"""SequencePretrainer everywhere the DLRM runs (issue 41): 2D with replica sync and QComms, checkpoints resharded,
resumed, evaluated and exported, and the sequence DataModules' evaluation batches on several ranks (gloo)."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_recsys.testing.oracle import assemble
from lightning_recsys.testing.oracle.pretrain import (
    ITEM_KEY, ITEMS, MAX_LENGTH, STEPS, PretrainDataModule, PretrainLogConfig, fit_sharded, global_batch, is_table, make_model,
    sgd_strategy, table_shards, train_two_replicas, train_unsharded,
)
from lightning_recsys.testing.processes import run_ranks
from safetensors.torch import load_file

from lightning_recsys import QCommsConfig, ReplicaSyncConfig
from lightning_recsys.checkpoint import export_safetensors
from lightning_recsys.data.sequences import SequenceFileDataModule
from lightning_recsys.data.synthetic import SyntheticPretrainDataModule
from lightning_recsys.models import SequencePretrainer
from lightning_recsys.models.pretrainer_ops import last_entries
from lightning_recsys.models.ranking_metrics import RankingMetrics
from lightning_recsys.parallel.ranking import UnshardedItemRanking

# ----------------------------------------------------------------- 2D: 2 nodes x 2 processes
WORLD, PER_NODE, NODES = 4, 2, 2
PARTNER = {0: 2, 1: 3, 2: 0, 3: 1}  # a sharding group per node; the replica of rank r is rank r + 2 (mod 4)
FP8_DIM = 16  # fp8 scales blocks of 8 or 16 values (at 4 it runs as bf16)
# One step's largest table-update error relative to the largest update; the 1D fp8 test's bound (about 2x the
# measured error, fp8 e4m3/e5m2 keeping 4/3 significant bits, amplified by the softmax at temperature 0.5).
FP8_TOLERANCE = 1e-1


def _dense(model: SequencePretrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not is_table(k)}


def _fit_2d(rank: int, world_size: int) -> dict:
    out: dict = {}
    for name, overlap in (("blocking", False), ("overlapped", True)):
        model = make_model()
        sync = ReplicaSyncConfig(rows="touched", overlap=overlap)
        strategy = sgd_strategy(sharding_types=["row_wise"], sharding_group_size=PER_NODE, replica_sync=sync)
        _, trainer, _ = fit_sharded(rank, world_size, strategy, model=model, devices=PER_NODE, num_nodes=NODES)
        assert trainer.global_step == STEPS
        out[name] = {"shards": table_shards(model), "dense": _dense(model)}
    model = make_model(embedding_dim=FP8_DIM)
    strategy = sgd_strategy(
        sharding_types=["row_wise"], sharding_group_size=PER_NODE, replica_sync=ReplicaSyncConfig(),
        qcomms=QCommsConfig(forward="fp8", backward="fp8"),
    )
    fit_sharded(rank, world_size, strategy, model=model, devices=PER_NODE, num_nodes=NODES, steps=1)
    out["fp8"] = {"shards": table_shards(model), "effective": strategy.effective_qcomms.precisions["sequence_all_to_all"]}
    return out


@pytest.fixture(scope="module")
def two_d_runs() -> list[dict]:
    return run_ranks(_fit_2d, WORLD, timeout=400, ranks_per_node=PER_NODE)


def _replicas_identical(results: list[dict], name: str) -> None:
    for rank, partner in PARTNER.items():
        mine, theirs = results[rank][name]["shards"], results[partner][name]["shards"]
        assert mine.keys() == theirs.keys()
        for key in mine:
            for (offsets, value), (other_offsets, other) in zip(mine[key], theirs[key], strict=True):
                assert offsets == other_offsets and torch.equal(value, other), f"{name}: rank {rank} and {partner} differ in {key}"


@pytest.mark.slow
@pytest.mark.parametrize("name, overlap", [("blocking", False), ("overlapped", True)])
def test_2d_touched_row_sync_every_step_equals_the_unsharded_oracle(two_d_runs, name, overlap):
    """Blocking: 2D with SGD and a sync every step IS unsharded SGD on the global batches (1D's oracle).
    Overlapped: each average lands one step late; the oracle of two unsharded replicas does the same."""
    expected = train_two_replicas(PER_NODE, overlap=overlap)
    if not overlap:  # the two-replica oracle, synced at once, is 1D's oracle
        for key, value in train_unsharded(WORLD).state.items():
            torch.testing.assert_close(expected[key], value, msg=lambda m: f"{key}: {m}")
    else:  # the late averages matter: this case can tell overlapped from blocking
        assert not torch.allclose(expected[ITEM_KEY], train_unsharded(WORLD).state[ITEM_KEY], atol=1e-3)
    _replicas_identical(two_d_runs, name)
    group = [two_d_runs[r][name]["shards"] for r in range(PER_NODE)]  # rank 0's sharding group holds a whole replica
    for key, value in expected.items():
        if is_table(key):
            torch.testing.assert_close(assemble(group, key, value), value, msg=lambda m: f"{key}: {m}")
        else:
            for rank in range(WORLD):
                torch.testing.assert_close(two_d_runs[rank][name]["dense"][key], value, msg=lambda m: f"rank {rank} {key}: {m}")
    assert not torch.allclose(expected[ITEM_KEY], make_model().state_dict()[ITEM_KEY])


@pytest.mark.slow
def test_2d_fp8_sequence_all_to_all_with_negatives_stays_within_fp8_tolerance(two_d_runs):
    expected = train_unsharded(WORLD, steps=1, embedding_dim=FP8_DIM).state[ITEM_KEY]
    initial = make_model(embedding_dim=FP8_DIM).state_dict()[ITEM_KEY]
    assert all(r["fp8"]["effective"][0].startswith("fp8") for r in two_d_runs), two_d_runs[0]["fp8"]["effective"]
    _replicas_identical(two_d_runs, "fp8")
    items = assemble([two_d_runs[r]["fp8"]["shards"] for r in range(PER_NODE)], ITEM_KEY, expected)
    update, expected_update = items - initial, expected - initial
    error = float((update - expected_update).abs().max() / expected_update.abs().max())
    assert error < FP8_TOLERANCE, error
    assert not torch.equal(items, expected)  # quantized: not the fp32 result bit for bit
    assert torch.equal(items[expected_update == 0], initial[expected_update == 0])  # untouched rows stay untouched


# ----------------------------------------------------------------- checkpoints: save, reshard, evaluate, predict, export, resume
TOP_K, EVAL_K = 5, (1, 5, 10)
CHECKPOINT_MODEL = dict(embedding_device="meta", seed=None, predict_top_k=TOP_K, eval_k=EVAL_K)  # only the shards exist
LAYOUTS = {  # name: (sharding types, processes per node, nodes)
    "row_wise on 2": (["row_wise"], 2, 1),
    "column_wise on 2": (["column_wise"], 2, 1),
    "2D 2x2 row_wise on 4": (["row_wise"], PER_NODE, NODES),
}


def _trainer(strategy, devices: int, num_nodes: int = 1, **kwargs) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )


def _evaluations(trainer, model_factory, ckpt_path: str | None) -> dict:
    out = {}
    for fn in ("validate", "test", "predict"):
        model = model_factory()
        out[fn] = getattr(trainer(), fn)(model, datamodule=PretrainDataModule(), ckpt_path=ckpt_path)
    out["tables"] = table_shards(model)
    return out


def _fit_and_save(rank: int, world_size: int, ckpt_dir: str) -> dict:
    model = make_model(**{**CHECKPOINT_MODEL, "seed": 100 + rank})  # each rank's meta shards drawn from its own seed
    trainer = _trainer(
        sgd_strategy(sharding_types=["table_wise"]), world_size, max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, filename="fitted")],
    )
    trainer.fit(model, datamodule=PretrainDataModule())
    out = _evaluations(lambda: _trainer(sgd_strategy(sharding_types=["table_wise"]), world_size), lambda: model, None)
    return out


def _evaluate_resharded(rank: int, world_size: int, ckpt_path: str, layout: str) -> dict:
    sharding_types, devices, num_nodes = LAYOUTS[layout]
    strategy = lambda: sgd_strategy(sharding_types=sharding_types, sharding_group_size=devices)  # noqa: E731
    return _evaluations(lambda: _trainer(strategy(), devices, num_nodes), lambda: make_model(**CHECKPOINT_MODEL), ckpt_path)


def _brute_force(model: SequencePretrainer) -> dict:
    """The unsharded model's validation metrics and top-K over the validation users (the test and predict users too)."""
    config = PretrainLogConfig()
    batch = global_batch(config, "val", 0)
    model.eval()
    with torch.no_grad():
        queries = model.user_vectors(batch)
    ranking = UnshardedItemRanking(model.state_dict()[ITEM_KEY])
    metrics = RankingMetrics(EVAL_K)
    targets = last_entries(batch.sparse["item_id"].lengths(), batch.next_item_ids)
    metrics.update(ranking.target_ranks(queries, targets, batch.seen_ids, batch.seen_lengths))
    scores, ids = ranking.top_k(queries, TOP_K, batch.seen_ids, batch.seen_lengths)
    metric_values = {k: float(v) for k, v in metrics.compute().items()}
    return {"metrics": metric_values, "queries": queries, "top_k_ids": ids, "top_k_scores": scores}


def _predictions(results: list[dict]) -> dict[str, torch.Tensor]:
    """Each rank's predict outputs (one batch: its slice of the global batch), in global example order."""
    return {key: torch.cat([r["predict"][0][key] for r in results]) for key in ("user_vectors", "top_k_ids", "top_k_scores")}


def _check_against(expected: dict, results: list[dict], where: str) -> None:
    for stage in ("val", "test"):  # test reads the same users here
        logged = results[0]["validate" if stage == "val" else "test"][0]
        for name, value in expected["metrics"].items():
            assert logged[f"{stage}/{name}"] == pytest.approx(value, abs=1e-6), f"{where}: {stage}/{name}"
    predicted = _predictions(results)
    torch.testing.assert_close(predicted["user_vectors"], expected["queries"], msg=lambda m: f"{where}: {m}")
    assert torch.equal(predicted["top_k_ids"], expected["top_k_ids"]), where
    torch.testing.assert_close(predicted["top_k_scores"], expected["top_k_scores"], msg=lambda m: f"{where}: {m}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("pretrain_checkpoint")
    results = run_ranks(_fit_and_save, 2, str(directory), timeout=300)
    checkpoint = directory / "fitted.ckpt"
    unsharded = SequencePretrainer.load_from_checkpoint(checkpoint)
    items = assemble([r["tables"] for r in results], ITEM_KEY, unsharded.state_dict()[ITEM_KEY])
    return {"results": results, "checkpoint": str(checkpoint), "items": items, "unsharded": unsharded, "dir": directory}


def test_evaluate_and_predict_of_the_fitted_sharded_pretrainer_match_brute_force_on_its_weights(saved):
    assert torch.equal(saved["items"], saved["unsharded"].state_dict()[ITEM_KEY])  # what was saved is what was trained
    expected = _brute_force(saved["unsharded"])
    assert 0 < expected["metrics"]["mrr"] < 1 and expected["top_k_ids"].unique().numel() > TOP_K  # not one constant answer
    _check_against(expected, saved["results"], "table_wise on 2 (in memory)")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_table_wise_checkpoint_loads_into_another_layout_bit_identical_and_evaluates_the_same(saved, layout):
    _, devices, num_nodes = LAYOUTS[layout]
    results = run_ranks(_evaluate_resharded, devices * num_nodes, saved["checkpoint"], layout, timeout=400, ranks_per_node=devices)
    group = [r["tables"] for r in results[:devices]]  # the first sharding group holds a whole copy
    assert torch.equal(assemble(group, ITEM_KEY, saved["items"]), saved["items"]), layout
    if num_nodes > 1:
        for rank in range(devices, devices * num_nodes):
            assert results[rank]["tables"].keys() == results[rank - devices]["tables"].keys()
            for key in results[rank]["tables"]:
                for (o, value), (p, other) in zip(results[rank]["tables"][key], results[rank - devices]["tables"][key], strict=True):
                    assert o == p and torch.equal(value, other), f"{layout}: replica of rank {rank} differs in {key}"
    _check_against(_brute_force(saved["unsharded"]), results, layout)
    for name, value in saved["results"][0]["validate"][0].items():  # the same val metrics as the layout that trained
        assert results[0]["validate"][0][name] == pytest.approx(value, abs=1e-6), f"{layout}: {name}"


def test_export_safetensors_of_the_sharded_checkpoint_ranks_as_the_sharded_model(saved):
    rebuilt = make_model(seed=0, predict_top_k=TOP_K, eval_k=EVAL_K)
    rebuilt.load_state_dict(load_file(export_safetensors(saved["checkpoint"], saved["dir"] / "fitted.safetensors")))
    assert torch.equal(rebuilt.state_dict()[ITEM_KEY], saved["items"])
    _check_against(_brute_force(rebuilt), saved["results"], "safetensors export")


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append((trainer.global_step, float(outputs["loss"])))


def _fit_epochs(rank: int, world_size: int, ckpt_dir: str, max_epochs: int, ckpt_path: str | None) -> dict:
    losses = _Losses()
    trainer = _trainer(
        sgd_strategy(sharding_types=["table_wise"]), world_size, max_epochs=max_epochs, limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=-1), losses],
    )
    model = make_model(embedding_device="meta", seed=100 + rank, dense_optimizer="adam")  # Adam: its state must resume too
    trainer.fit(model, datamodule=PretrainDataModule(), ckpt_path=ckpt_path)
    return {"losses": losses.losses, "tables": table_shards(model), "dense": _dense(model)}


@pytest.mark.slow
def test_fit_resumed_from_a_sharded_checkpoint_continues_exactly(tmp_path):
    full = run_ranks(_fit_epochs, 2, str(tmp_path / "full"), 2, None, timeout=300)
    run_ranks(_fit_epochs, 2, str(tmp_path / "resumed"), 1, None, timeout=300)
    resumed = run_ranks(_fit_epochs, 2, str(tmp_path / "resumed"), 2, "last", timeout=300)
    for rank in range(2):
        assert len(full[rank]["losses"]) == 2 * STEPS
        assert resumed[rank]["losses"] == full[rank]["losses"][STEPS:], rank
        for key, pieces in full[rank]["tables"].items():
            for (offsets, expected), (resumed_offsets, actual) in zip(pieces, resumed[rank]["tables"][key], strict=True):
                assert offsets == resumed_offsets and torch.equal(actual, expected), f"rank {rank}: {key}"
        for key, expected in full[rank]["dense"].items():
            assert torch.equal(resumed[rank]["dense"][key], expected), f"rank {rank}: {key}"


# ----------------------------------------------------------------- the sequence DataModules on 2 ranks
EVAL_USERS = 5  # users with a validation example; TRAIN_ONLY_USERS more with 2 items (a training example, no evaluation)
TRAIN_ONLY_USERS = 3


def _write_sequences(path) -> None:
    generator = torch.Generator().manual_seed(5)
    lines = []
    for user in range(1, EVAL_USERS + TRAIN_ONLY_USERS + 1):
        length = 7 if user <= EVAL_USERS else 2
        lines += [f"{user} {int(item) + 1}" for item in torch.randint(0, 32, (length,), generator=generator)]  # ids from 1
    path.write_text("\n".join(lines) + "\n")


class _EvaluatedUsers(Callback):
    """Counts the users this rank's validation steps rank."""

    def __init__(self) -> None:
        self.users = 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.users += int(batch.seen_lengths.numel())


def _file_data(path: str, global_batch_size: int) -> SequenceFileDataModule:
    return SequenceFileDataModule(
        path, max_length=MAX_LENGTH, num_negatives=8, global_batch_size=global_batch_size, shuffle=False, num_items=ITEMS
    )


def _fit_validate_file(rank: int, world_size: int, path: str, global_batch_size: int, sharding_type: str, ckpt: str) -> dict:
    counter = _EvaluatedUsers()
    data = _file_data(path, global_batch_size)
    model = make_model(eval_k=EVAL_K, num_action_types=0)  # the file has no actions
    strategy = sgd_strategy(sharding_types=[sharding_type])
    trainer = _trainer(strategy, world_size, max_epochs=1, limit_val_batches=0, enable_checkpointing=False)
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(ckpt)
    evaluation = _trainer(sgd_strategy(sharding_types=[sharding_type]), world_size, callbacks=[counter])
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning_recsys.parallel.input.input_guard").addHandler(handler)
    metrics = evaluation.validate(model, datamodule=data, verbose=False)[0]
    loader = evaluation.val_dataloaders
    return {
        "metrics": metrics, "users": counter.users, "skipped": getattr(loader, "skipped_steps", None), "steps": trainer.global_step,
        "warnings": warnings,
    }


def _single_process_metrics(ckpt: str, path: str, global_batch_size: int) -> dict:
    model = SequencePretrainer.load_from_checkpoint(ckpt)
    trainer = _trainer("auto", 1)
    return trainer.validate(model, datamodule=_file_data(path, global_batch_size), verbose=False)[0]


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_a_sequence_file_whose_last_eval_batch_splits_unevenly_evaluates_every_user(tmp_path, sharding_type):
    """6 per global batch: the 5 validation users split 2 and 3 over the 2 ranks; the full ranking takes both sizes."""
    path = tmp_path / "sequences.txt"
    _write_sequences(path)
    ckpt = str(tmp_path / "fitted.ckpt")
    results = run_ranks(_fit_validate_file, 2, str(path), 6, sharding_type, ckpt, timeout=300)
    assert [r["users"] for r in results] == [2, 3] and all(r["skipped"] == 0 and not r["warnings"] for r in results), results
    assert results[0]["steps"] == 1  # 8 training examples: one global batch of 6
    expected = _single_process_metrics(ckpt, str(path), 6)
    for name, value in expected.items():
        assert results[0]["metrics"][name] == pytest.approx(value, abs=1e-6), name


def test_an_eval_batch_smaller_than_the_world_size_is_skipped_on_every_rank_and_counted(tmp_path):
    """4 per global batch: the 5th validation user is alone in the last one, so rank 0's slice is empty. The input guard
    skips that step on every rank (TorchRec's lookups cannot take an empty batch); the skip is counted per loader and
    logged, and the DataModule's docstring says which users are lost (the last N mod B when that is below the world size)."""
    path = tmp_path / "sequences.txt"
    _write_sequences(path)
    ckpt = str(tmp_path / "fitted.ckpt")
    results = run_ranks(_fit_validate_file, 2, str(path), 4, "table_wise", ckpt, timeout=300)
    assert sum(r["users"] for r in results) == EVAL_USERS - 1 and all(r["skipped"] == 1 for r in results), results
    for result in results:  # every rank says which step it skipped and why
        assert any("batch 1: batch sizes per rank [0, 1]; skipped on every rank" in w for w in result["warnings"]), result["warnings"]


SYNTHETIC = dict(num_users=24, num_items=64, num_clusters=4, min_sequence_length=4, max_sequence_length=10, num_action_types=3,
                 max_length=6, num_negatives=8, global_batch_size=8, seed=3)


def _fit_validate_synthetic(rank: int, world_size: int, sharding_type: str, ckpt: str) -> dict:
    counter = _EvaluatedUsers()
    data = SyntheticPretrainDataModule(**SYNTHETIC)
    model = make_model(eval_k=EVAL_K)
    strategy = sgd_strategy(sharding_types=[sharding_type])
    trainer = _trainer(strategy, world_size, max_epochs=1, enable_checkpointing=False, num_sanity_val_steps=0, callbacks=[counter])
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(ckpt)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"metrics": metrics, "users": counter.users, "steps": trainer.global_step,
            "val_users": data.num_examples["val"]}


def test_synthetic_pretrain_data_fits_and_validates_on_two_ranks_as_on_one(tmp_path):
    ckpt = str(tmp_path / "fitted.ckpt")
    results = run_ranks(_fit_validate_synthetic, 2, "column_wise", ckpt, timeout=300)
    assert results[0]["steps"] == 24 // 8  # every user has a training example
    assert results[0]["val_users"] == 24 and sum(r["users"] for r in results) == 24, results  # the epoch's validation saw every user
    unsharded = SequencePretrainer.load_from_checkpoint(ckpt)
    single = _trainer("auto", 1).validate(unsharded, datamodule=SyntheticPretrainDataModule(**SYNTHETIC), verbose=False)[0]
    assert set(single) <= set(results[0]["metrics"])
    for name, value in single.items():
        assert results[0]["metrics"][name] == pytest.approx(value, abs=1e-6), name

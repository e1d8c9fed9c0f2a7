"""SequenceParquetDataModule under TwoDRecStrategy on 2 processes: a fit whose evaluation ranks every user once,
embeddings out, a bad file raising on both ranks, and an exact resume after a kill mid-epoch."""

from __future__ import annotations

import os
import signal

import numpy as np
import pyarrow.parquet as pq
import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_recsys import DCPCheckpointIO, EmbeddingOptimizerConfig, TwoDRecStrategy
from lightning_recsys.data.parquet.embedding_writer import UserEmbeddingWriter
from lightning_recsys.data.parquet.module import SequenceParquetDataModule
from lightning_recsys.data.parquet.writing import PreparedWriter
from lightning_recsys.models import SequencePretrainer
from lightning_recsys.planner.config import PlanningConfig
from lightning_recsys.testing.processes import run_ranks

WORLD_SIZE = 2
NUM_ITEMS = 40
MAX_LENGTH = 6
EPOCHS = 2
KILL_AT, SAVE_EVERY = 17, 4  # the last checkpoint before the kill is at step 16, in the middle of epoch 1
GROUP_SIZES = (40, 33, 47, 39)


def _write(directory, corrupt: bool = False) -> None:
    rng = np.random.default_rng(5)
    writer = PreparedWriter(directory, NUM_ITEMS, groups_per_file=2)
    first = 0
    for size in GROUP_SIZES:
        lengths = rng.choice([1, 2, 3, 4, 6, 9, 15], size=size)
        writer.write_group(np.arange(first, first + size) + 1000, lengths, rng.integers(0, NUM_ITEMS, size=int(lengths.sum())))
        first += size
    writer.close()
    if corrupt:  # the last row group, read by rank 1 only: its item_rows pages zeroed, the footer intact
        path = directory / "users/part-00001.parquet"
        column = pq.ParquetFile(path).metadata.row_group(1).column(1)
        start = column.dictionary_page_offset or column.data_page_offset
        data = bytearray(path.read_bytes())
        data[start : start + 60] = bytes(60)
        path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("parquet_pretrain")
    _write(root / "good")
    _write(root / "bad", corrupt=True)
    return root


class _Record(Callback):
    def __init__(self) -> None:
        self.train: list[tuple[int, list[int], list[int]]] = []
        self.val_users: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.train.append((trainer.global_step, batch.sparse.values().tolist(), batch.sparse.lengths().tolist()))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.val_users.append(batch.user_ids.tolist())


class _KillAt(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def _data(directory) -> SequenceParquetDataModule:
    return SequenceParquetDataModule(str(directory), max_length=MAX_LENGTH, num_negatives=5, global_batch_size=8, shuffle_buffer=6)


def _model(**overrides) -> SequencePretrainer:
    import torch

    torch.manual_seed(3)
    arguments = dict(num_items=NUM_ITEMS, embedding_dim=8, max_length=MAX_LENGTH, num_layers=1, num_heads=1, dropout=0.0, dense_lr=0.01)
    return SequencePretrainer(**{**arguments, **overrides})


def _trainer(world_size: int, callbacks: list, **kwargs) -> Trainer:
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.05),
        planning=PlanningConfig(sharding_types=["row_wise", "table_wise"]), process_group_timeout=60,
        checkpoint_io=DCPCheckpointIO(),
    )
    options = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return Trainer(accelerator="cpu", devices=world_size, strategy=strategy, callbacks=callbacks, **{**options, **kwargs})


def _fit(world_size: int, directory, ckpt_dir: str, callbacks: list, ckpt_path: str | None = None) -> _Record:
    record = _Record()
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=-1, every_n_train_steps=SAVE_EVERY)
    trainer = _trainer(world_size, [record, checkpoint, *callbacks], max_epochs=EPOCHS, check_val_every_n_epoch=EPOCHS)
    trainer.fit(_model(), datamodule=_data(directory), ckpt_path=ckpt_path)
    return record


def _everything(rank: int, world_size: int, root: str) -> dict:
    """One world for all but the kill: fit (with validation), predict into shards, then a bad file."""
    from pathlib import Path

    root_path = Path(root)
    record = _fit(world_size, root_path / "good", str(root_path / "full_ckpts"), [])
    trainer = _trainer(world_size, [UserEmbeddingWriter(str(root_path / "embeddings"))])
    trainer.predict(_model(predict_top_k=3), datamodule=_data(root_path / "good"), return_predictions=False)
    try:
        _trainer(world_size, [], max_steps=3, limit_val_batches=0).fit(_model(), datamodule=_data(root_path / "bad"))
        bad_error = None
    except Exception as error:  # noqa: BLE001 - the test inspects it
        bad_error = f"{type(error).__name__}: {error}"
    return {"train": record.train, "val_users": record.val_users, "bad_error": bad_error}


def _killed(rank: int, world_size: int, root: str) -> None:
    _fit(world_size, os.path.join(root, "good"), os.path.join(root, "killed_ckpts"), [_KillAt()])


def _resumed(rank: int, world_size: int, root: str) -> list:
    return _fit(world_size, os.path.join(root, "good"), os.path.join(root, "killed_ckpts"), [], ckpt_path="last").train


def _resumed_elsewhere(rank: int, world_size: int, root: str, ckpt_path: str) -> str | None:
    try:
        _fit(world_size, os.path.join(root, "good"), os.path.join(root, "elsewhere_ckpts"), [], ckpt_path=ckpt_path)
    except ValueError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def world(prepared):
    return run_ranks(_everything, WORLD_SIZE, str(prepared), timeout=420)


def _user_lengths(directory) -> np.ndarray:
    tables = [pq.read_table(directory / f"users/part-0000{i}.parquet") for i in range(2)]
    return np.concatenate([t.column("item_rows").combine_chunks().value_lengths().to_numpy() for t in tables])


def test_validation_ranks_every_user_with_three_events_exactly_once_over_both_ranks(world, prepared):
    users = [u for result in world for batch in result["val_users"] for u in batch]
    expected = (np.arange(sum(GROUP_SIZES)) + 1000)[_user_lengths(prepared / "good") >= 3]
    assert sorted(users) == expected.tolist()
    assert len(world[0]["val_users"]) == len(world[1]["val_users"]) and all(world[0]["val_users"]) and all(world[1]["val_users"])


def test_training_ran_the_same_full_batches_on_both_ranks(world):
    steps = [[step for step, _, _ in result["train"]] for result in world]
    assert steps[0] == steps[1] == list(range(len(steps[0]))) and len(steps[0]) > KILL_AT + 2


def test_predict_writes_one_shard_per_rank_with_every_user_once(world, prepared):
    shards = sorted((prepared / "embeddings").glob("*.parquet"))
    assert [s.name for s in shards] == ["embeddings-00000-of-00002.parquet", "embeddings-00001-of-00002.parquet"]
    users = [u for s in shards for u in pq.read_table(s, columns=["user_id"]).column(0).to_pylist()]
    assert sorted(users) == (np.arange(sum(GROUP_SIZES)) + 1000).tolist()
    first = pq.read_table(shards[0])
    assert set(first.column_names) == {"user_id", "user_vector", "top_k_rows", "top_k_item_ids", "top_k_scores"}
    assert first.schema.field("user_vector").type.list_size == 8 and first.schema.field("top_k_rows").type.list_size == 3
    assert first.column("top_k_item_ids").to_pylist() == first.column("top_k_rows").to_pylist()  # PreparedWriter: raw id = row


def test_a_corrupt_file_that_only_rank_1_reads_raises_on_both_ranks(world):
    errors = [result["bad_error"] for result in world]
    assert all(errors), errors
    assert "part-00001.parquet, row group 1: cannot be read" in errors[1], errors[1]
    assert "rank 1" in errors[0] and "part-00001.parquet" in errors[0], errors[0]


def test_a_run_killed_mid_epoch_resumes_with_the_uninterrupted_runs_batches(world, prepared):
    with pytest.raises(AssertionError, match="exit code -9"):
        run_ranks(_killed, WORLD_SIZE, str(prepared), timeout=300)
    resumed = run_ranks(_resumed, WORLD_SIZE, str(prepared), timeout=300)
    resumed_from = KILL_AT - KILL_AT % SAVE_EVERY
    for rank in range(WORLD_SIZE):
        assert resumed[rank][0][0] == resumed_from
        assert resumed[rank] == world[rank]["train"][resumed_from:], rank
    # The same mid-epoch checkpoint on another number of processes: refused, saying why and what to do.
    mid_epoch = prepared / "killed_ckpts" / f"epoch=1-step={resumed_from}.ckpt"
    assert mid_epoch.exists()
    (error,) = run_ranks(_resumed_elsewhere, 1, str(prepared), str(mid_epoch), timeout=300)
    assert error is not None and "saved in the middle of an epoch under other settings (world_size: saved 2, now 1)" in error, error

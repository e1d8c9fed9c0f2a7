"""DCP checkpoints through Lightning: ModelCheckpoint + fit(ckpt_path=...) resume exactly, in separate launches."""

from __future__ import annotations

import os
import signal

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_recsys.testing.oracle import assemble
from lightning_recsys.testing.oracle.click import make_model, shards_of
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import DCPCheckpointIO, EmbeddingOptimizerConfig, TwoDRecStrategy
from lightning_recsys.checkpoint import is_committed, read_meta
from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.planner.config import PlanningConfig

WORLD_SIZE = 2
STEPS_PER_EPOCH = 3
CONFIG = SyntheticClickLogConfig(
    table_sizes=[40, 64, 24], num_dense_features=4, pooling_factors=[2.0, 3.0, 1.0],
    global_batch_size=16, train_batches=STEPS_PER_EPOCH, val_batches=1, seed=7,
)


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append((trainer.global_step, float(outputs["loss"])))


class _KillAt(Callback):
    """SIGKILL this rank after a given step: a preempted node, no cleanup."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _fit(
    rank: int, world_size: int, ckpt_dir: str, max_epochs: int, ckpt_path: str | None, callbacks: list,
    every_n: int | None = None, async_save: bool = False,
) -> dict:
    losses = _Losses()
    strategy = TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1),
        planning=PlanningConfig(sharding_types=["row_wise", "table_wise"]),
        process_group_timeout=60,
        checkpoint_io=DCPCheckpointIO(async_save=async_save),
    )
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=-1, every_n_train_steps=every_n)
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=max_epochs, limit_val_batches=0,
        logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint, losses, *callbacks],
    )
    model = make_model()
    model.dense_optimizer_name = "adagrad"  # stateful dense optimizer: its state must resume too
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG), ckpt_path=ckpt_path)
    return {"losses": losses.losses, "shards": shards_of(model), "global_step": trainer.global_step}


def _uninterrupted(rank, world_size, ckpt_dir):
    return _fit(rank, world_size, ckpt_dir, 2, None, [])


def _first_epoch(rank, world_size, ckpt_dir):
    return _fit(rank, world_size, ckpt_dir, 1, None, [])


def _resume_last(rank, world_size, ckpt_dir):
    return _fit(rank, world_size, ckpt_dir, 2, "last", [])


def _first_epoch_async(rank, world_size, ckpt_dir):
    return _fit(rank, world_size, ckpt_dir, 1, None, [], async_save=True)


def test_resume_from_last_equals_uninterrupted_training(tmp_path):
    full = run_ranks(_uninterrupted, WORLD_SIZE, str(tmp_path / "full"), timeout=240)
    first = run_ranks(_first_epoch, WORLD_SIZE, str(tmp_path / "resumed"), timeout=240)
    assert is_committed(tmp_path / "resumed" / "last.ckpt")
    meta = read_meta(tmp_path / "resumed" / "last.ckpt")
    assert (meta.world_size, meta.step) == (WORLD_SIZE, STEPS_PER_EPOCH)
    resumed = run_ranks(_resume_last, WORLD_SIZE, str(tmp_path / "resumed"), timeout=240)  # a new process group

    for rank in range(WORLD_SIZE):
        assert first[rank]["losses"] == full[rank]["losses"][:STEPS_PER_EPOCH]
        # Bit-exact on CPU: same data, same order of operations, every optimizer state restored.
        assert resumed[rank]["losses"] == full[rank]["losses"][STEPS_PER_EPOCH:], rank
        assert resumed[rank]["global_step"] == full[rank]["global_step"] == 2 * STEPS_PER_EPOCH
        for key, pieces in full[rank]["shards"].items():
            for (offsets, expected), (resumed_offsets, actual) in zip(pieces, resumed[rank]["shards"][key]):
                assert offsets == resumed_offsets and torch.equal(actual, expected), f"rank {rank}: {key}"

    # The same checkpoint resumed on ONE rank (the whole global batch there): the same training,
    # re-cut tables; equal to the 2-rank run up to summation order.
    (single,) = run_ranks(_resume_last, 1, str(tmp_path / "resumed"), timeout=240)
    like = make_model().state_dict()
    for key in single["shards"]:
        torch.testing.assert_close(
            assemble([single["shards"]], key, like[key]), assemble([r["shards"] for r in full], key, like[key]), msg=key
        )


def _fit_then_save(rank, world_size, ckpt_dir, ckpt_path, name):
    strategy = TwoDRecStrategy(process_group_timeout=60)
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(make_model(), datamodule=SyntheticClickLogDataModule.from_config(CONFIG), ckpt_path=ckpt_path)
    trainer.save_checkpoint(os.path.join(ckpt_dir, name))  # as a training script ends
    return trainer.global_step


def test_a_save_after_resuming_a_finished_run_succeeds(tmp_path):
    """A rerun of a finished job: fit(ckpt_path=<its final save>) has nothing left to train, then the script saves."""
    assert run_ranks(_fit_then_save, WORLD_SIZE, str(tmp_path), None, "final.ckpt", timeout=240) == [STEPS_PER_EPOCH] * WORLD_SIZE
    # The loop restored "3 steps ran in this epoch" but the loader handed on no batch: the save raised
    # "loader position: ... the loop and the loader disagree on what was trained".
    steps = run_ranks(_fit_then_save, WORLD_SIZE, str(tmp_path), str(tmp_path / "final.ckpt"), "again.ckpt", timeout=240)
    assert steps == [STEPS_PER_EPOCH] * WORLD_SIZE
    assert read_meta(tmp_path / "again.ckpt").step == STEPS_PER_EPOCH


def _fit_with(rank, world_size, ckpt_dir, optimizer, ckpt_path):
    strategy = TwoDRecStrategy(process_group_timeout=60, embedding_optimizer=EmbeddingOptimizerConfig(name=optimizer, lr=0.1))
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=2, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    try:
        trainer.fit(make_model(), datamodule=SyntheticClickLogDataModule.from_config(CONFIG), ckpt_path=ckpt_path)
    except ValueError as error:
        return str(error)
    trainer.save_checkpoint(os.path.join(ckpt_dir, f"{optimizer}.ckpt"))
    return None


def test_resuming_with_another_embedding_optimizer_says_what_to_do_under_a_trainer(tmp_path):
    assert run_ranks(_fit_with, WORLD_SIZE, str(tmp_path), "sgd", None, timeout=240) == [None] * WORLD_SIZE
    errors = run_ranks(_fit_with, WORLD_SIZE, str(tmp_path), "rowwise_adagrad", str(tmp_path / "sgd.ckpt"), timeout=240)
    for error in errors:
        assert "saved with embedding optimizer 'sgd'" in error, error
        # The Trainer-free remedies (strict=False, load_embedding_optimizer_state=False) cannot be passed to
        # Trainer.fit: the error must say what works there.
        assert "Under a Trainer" in error and "strict_loading = False" in error, error
        assert "EmbeddingOptimizerConfig(name='sgd')" in error and "load_unsharded" in error, error


def test_async_save_commits_a_loadable_checkpoint(tmp_path):
    run_ranks(_first_epoch_async, WORLD_SIZE, str(tmp_path), timeout=240)
    assert is_committed(tmp_path / "last.ckpt") and read_meta(tmp_path / "last.ckpt").step == STEPS_PER_EPOCH
    assert all(r["global_step"] == 2 * STEPS_PER_EPOCH for r in run_ranks(_resume_last, WORLD_SIZE, str(tmp_path), timeout=240))


def _killed_at_step_5(rank, world_size, ckpt_dir):
    return _fit(rank, world_size, ckpt_dir, 3, None, [_KillAt(5)], every_n=2)


def _resume_after_kill(rank, world_size, ckpt_dir):
    return _fit(rank, world_size, ckpt_dir, 3, "last", [], every_n=2)


def _three_epochs(rank, world_size, ckpt_dir):
    return _fit(rank, world_size, ckpt_dir, 3, None, [])


def test_kill_mid_epoch_then_resume_from_last_loses_only_the_steps_since_the_checkpoint(tmp_path):
    full = run_ranks(_three_epochs, WORLD_SIZE, str(tmp_path / "full"), timeout=240)
    ckpt_dir = str(tmp_path / "ckpts")
    try:
        run_ranks(_killed_at_step_5, WORLD_SIZE, ckpt_dir, timeout=240)
        raise AssertionError("the ranks were supposed to be killed")
    except AssertionError as killed:
        assert "died without a result (exit code -9)" in str(killed)
    last = read_meta(tmp_path / "ckpts" / "last.ckpt")
    assert last.step == 4  # every 2 steps; step 5 was lost with the processes
    resumed = run_ranks(_resume_after_kill, WORLD_SIZE, ckpt_dir, timeout=240)
    assert all(r["global_step"] == 3 * STEPS_PER_EPOCH for r in resumed)
    assert resumed[0]["losses"][0][0] == 5  # the first step after the restored step 4
    # Step 4 ended mid-epoch; the resumed epoch goes on with its next batch, not its first again.
    for rank in range(WORLD_SIZE):
        assert resumed[rank]["losses"] == full[rank]["losses"][4:], rank


def _save_by_hand_after_async_fit(rank, world_size, ckpt_dir):
    strategy = TwoDRecStrategy(process_group_timeout=60, checkpoint_io=DCPCheckpointIO(async_save=True))
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(make_model(), datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    trainer.save_checkpoint(f"{ckpt_dir}/by_hand.ckpt")  # after teardown: no later save or teardown commits it
    return is_committed(f"{ckpt_dir}/by_hand.ckpt")


def test_an_async_save_after_fit_is_committed_before_it_returns(tmp_path):
    assert run_ranks(_save_by_hand_after_async_fit, WORLD_SIZE, str(tmp_path), timeout=240) == [True, True]
    assert read_meta(tmp_path / "by_hand.ckpt").step == STEPS_PER_EPOCH

"""A save onto a full filesystem (a 1 MiB tmpfs) fails with an error naming the path; the previous checkpoint still loads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import TwoDRecStrategy
from lightning_recsys.checkpoint import latest_checkpoint, load_unsharded
from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import DLRMRanker

# One checkpoint of this model takes about 0.7 MiB: the first fits on the 1 MiB tmpfs, a second copy does not.
CONFIG = SyntheticClickLogConfig(table_sizes=[5000, 10], num_dense_features=3, global_batch_size=8, train_batches=2, val_batches=1, seed=3)


def _model(embedding_device: str | None) -> DLRMRanker:
    torch.manual_seed(0)
    return DLRMRanker(
        table_sizes=CONFIG.table_sizes, num_dense_features=3, embedding_dim=32, dense_arch_layer_sizes=[8, 32],
        over_arch_layer_sizes=[4, 1], embedding_device=embedding_device,
    )


def _fit_saving_every_2_steps(rank: int, world_size: int, root: str) -> str:
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=TwoDRecStrategy(process_group_timeout=30), logger=False,
        enable_progress_bar=False, enable_model_summary=False, max_steps=4, limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=0, save_last=True)],
    )
    try:
        trainer.fit(_model("meta"), datamodule=SyntheticClickLogDataModule.from_config(CONFIG))  # saves at step 2, then fails at 4
    except Exception as error:  # noqa: BLE001 - the failure is the result
        return f"{type(error).__name__}: {error}"
    return "fit finished"


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs needs root (mount -t tmpfs); this test runs as a non-root user")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def test_a_save_onto_a_full_disk_names_the_path_and_keeps_the_previous_checkpoint(small_tmpfs: Path) -> None:
    results = run_ranks(_fit_saving_every_2_steps, 2, str(small_tmpfs), timeout=150)
    final = small_tmpfs / "last.ckpt"
    for message in results:
        assert "No space left on device" in message and f"saving checkpoint {str(final)!r} failed" in message, message
        assert "is untouched and still loads" in message, message
    assert latest_checkpoint(small_tmpfs) == final
    model = _model(None)
    loaded = load_unsharded(final, model)
    assert loaded.meta.step == 2  # the save at step 2; the one at step 4 failed

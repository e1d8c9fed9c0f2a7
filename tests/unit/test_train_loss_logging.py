"""``train/loss`` is logged every step under a progress bar, and on the loggers' steps without one."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import DLRMRanker


class _StepLosses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step - 1] = float(outputs["loss"])


def _fit(tmp_path: Path, *, progress_bar: bool, max_steps: int) -> tuple[dict[int, float], dict[int, float], float]:
    seed_everything(0)
    config = SyntheticClickLogConfig(table_sizes=[50, 50], num_dense_features=4, global_batch_size=64, train_batches=5, val_batches=1)
    model = DLRMRanker(table_sizes=config.table_sizes, num_dense_features=4, embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1])
    losses = _StepLosses()
    trainer = Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, log_every_n_steps=3, enable_progress_bar=progress_bar,
        logger=CSVLogger(tmp_path, name="run"), enable_checkpointing=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[losses],
    )
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(config))
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        logged = {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")}
    return logged, losses.losses, float(trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize("progress_bar", [True, False])
def test_the_loggers_get_the_same_train_loss_with_and_without_a_progress_bar(tmp_path, progress_bar):
    logged, losses, last = _fit(tmp_path, progress_bar=progress_bar, max_steps=8)
    # log_every_n_steps=3: the loggers write steps 2 and 5 (and 7, the last) whatever is shown.
    assert set(logged) >= {2, 5}
    for step, value in logged.items():
        assert value == pytest.approx(losses[step], rel=1e-6)
    assert last == pytest.approx(losses[7], rel=1e-6)  # the last step's loss reaches callbacks

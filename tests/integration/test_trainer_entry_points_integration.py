"""fit, then validate, test and predict on the same (already sharded) module, 2 processes."""

import csv
import math
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from multiprocess import run_ranks

from lightning_recsys import CommunicationMonitor, TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import DLRMRanker

CONFIG = SyntheticClickLogConfig(table_sizes=[50, 30], num_dense_features=3, global_batch_size=32, train_batches=4, val_batches=2, test_batches=2)


def _all_entry_points(rank: int, world_size: int, log_dir: str) -> dict:
    model = DLRMRanker(table_sizes=CONFIG.table_sizes, num_dense_features=3, embedding_dim=8, dense_arch_layer_sizes=[8, 8], embedding_device="meta")
    data = SyntheticClickLogDataModule(CONFIG)
    strategy = TwoDRecStrategy(process_group_timeout=60)
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=CSVLogger(log_dir, name="run"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        callbacks=[CommunicationMonitor()],
    )
    trainer.fit(model, datamodule=data)
    sharded = strategy.sharded_model
    validated = trainer.validate(model, datamodule=data, verbose=False)[0]
    tested = trainer.test(model, datamodule=data, verbose=False)[0]
    predictions = trainer.predict(model, datamodule=data)
    return {
        "same_sharding": strategy.sharded_model is sharded,
        "val_auc": validated["val/auc"],
        "test_ne": tested["test/ne"],
        "num_predictions": sum(p.numel() for p in predictions),
        "predictions_in_unit_interval": all(bool(((p >= 0) & (p <= 1)).all()) for p in predictions),
    }


def test_validate_test_predict_after_fit(tmp_path):
    results = run_ranks(_all_entry_points, 2, str(tmp_path), timeout=180)
    for r in results:
        assert r["same_sharding"]
        assert 0.0 <= r["val_auc"] <= 1.0 and math.isfinite(r["test_ne"])
        assert r["num_predictions"] == CONFIG.test_batches * CONFIG.global_batch_size // 2
        assert r["predictions_in_unit_interval"]
    # Epoch-level metrics are synced, so every rank reports the same value.
    assert results[0]["val_auc"] == results[1]["val_auc"]

    # CommunicationMonitor logged rank 0's measured bytes for every training step.
    with open(next(Path(tmp_path).glob("run/version_*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("comm/sparse_ids/all_to_all/world/bytes")]
    assert len(rows) == CONFIG.train_batches
    assert all(float(r["comm/sparse_ids/all_to_all/world/bytes"]) > 0 for r in rows)
    assert all(float(r["comm/dense_grads/all_reduce/world/bytes"]) > 0 for r in rows)
    assert all(float(r["comm/inter_node_bytes"]) == 0 for r in rows)  # one node

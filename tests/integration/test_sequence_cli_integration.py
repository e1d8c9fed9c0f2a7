"""Both sequence configs end to end through the `lightning-recsys` console script (2 CPU processes,
TwoDRecStrategy): `fit` writes a checkpoint, then `test --ckpt_path` evaluates it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lightning_recsys.testing.commands import run_cli
from movielens_files import write_tiny_movielens

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
TINY_SYNTHETIC = [
    "--data.init_args.global_batch_size", "64",
    "--data.init_args.train_batches", "3",
    "--data.init_args.val_batches", "1",
    "--data.init_args.test_batches", "2",
    "--data.init_args.max_history_length", "12",
    "--model.init_args.max_history", "12",
]  # fmt: skip



def _fit_then_test(config: str, overrides: list[str], tmp_path: Path) -> tuple[str, float]:
    fit = run_cli(["fit", "--config", str(CONFIGS / config), "--trainer.max_epochs", "1", "--trainer.enable_checkpointing", "true", *overrides], cwd=tmp_path, world_size=2)
    assert "Run summary" in fit and "TwoDRecStrategy: " in fit  # trained under the strategy the config names
    (checkpoint,) = sorted(tmp_path.glob("lightning_logs/version_*/checkpoints/*.ckpt"))
    tested = run_cli(["test", "--config", str(CONFIGS / config), *overrides, "--ckpt_path", str(checkpoint)], cwd=tmp_path, world_size=2)
    assert "Loaded model weights from the checkpoint" in tested
    match = re.search(r"test/auc\s*│\s*([0-9.]+)", tested)
    assert match, tested[-3000:]
    return tested, float(match.group(1))


@pytest.mark.slow
def test_synthetic_sequence_config_fits_and_tests_from_its_checkpoint(tmp_path):
    _, test_auc = _fit_then_test("synthetic_sequence.yaml", TINY_SYNTHETIC, tmp_path)
    assert 0.0 <= test_auc <= 1.0


@pytest.mark.slow
def test_movielens_sequence_config_fits_and_tests_from_its_checkpoint(tmp_path):
    write_tiny_movielens(tmp_path, spread_items=True, ratings_per_second=3)  # every user has a history
    overrides = ["--data.path", str(tmp_path), "--data.global_batch_size", "32", "--data.max_history_length", "8", "--model.init_args.max_history", "8"]
    tested, test_auc = _fit_then_test("movielens_sequence.yaml", overrides, tmp_path)
    assert 0.0 <= test_auc <= 1.0

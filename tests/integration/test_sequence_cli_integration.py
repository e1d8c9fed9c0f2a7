"""Both sequence configs end to end through the `lightning-recsys` console script (2 CPU processes,
TwoDRecStrategy): `fit` writes a checkpoint, then `test --ckpt_path` evaluates it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from movielens_files import write_tiny_movielens

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
CLI = str(Path(sys.executable).with_name("lightning-recsys"))
TINY_SYNTHETIC = [
    "--data.init_args.global_batch_size", "64",
    "--data.init_args.train_batches", "3",
    "--data.init_args.val_batches", "1",
    "--data.init_args.test_batches", "2",
    "--data.init_args.max_history_length", "12",
    "--model.init_args.max_history", "12",
]  # fmt: skip


def _run(args: list[str], cwd: Path, timeout: float = 300) -> str:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{output[-4000:]}"
    return output


def _fit_then_test(config: str, overrides: list[str], tmp_path: Path) -> tuple[str, float]:
    fit = _run([CLI, "fit", "--config", str(CONFIGS / config), "--trainer.max_epochs", "1", "--trainer.enable_checkpointing", "true", *overrides], tmp_path)
    assert "Run summary" in fit and "TwoDRecStrategy: " in fit  # trained under the strategy the config names
    (checkpoint,) = sorted(tmp_path.glob("lightning_logs/version_*/checkpoints/*.ckpt"))
    tested = _run([CLI, "test", "--config", str(CONFIGS / config), *overrides, "--ckpt_path", str(checkpoint)], tmp_path)
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

"""Both sequence configs end to end through the `lightning-recsys` console script (2 CPU processes,
TwoDRecStrategy): `fit` writes a checkpoint, then `test --ckpt_path` evaluates it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
CLI = str(Path(sys.executable).with_name("lightning-recsys"))
TINY_SYNTHETIC = [
    "--data.init_args.config.global_batch_size", "64",
    "--data.init_args.config.train_batches", "3",
    "--data.init_args.config.val_batches", "1",
    "--data.init_args.config.test_batches", "2",
    "--data.init_args.config.max_history_length", "12",
    "--model.init_args.max_history", "12",
]  # fmt: skip


def _run(args: list[str], cwd: Path, timeout: float = 300) -> str:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{output[-4000:]}"
    return output


def _write_movielens(directory: Path) -> None:
    """MovieLens-100k-format files: 20 users, 30 movies, 400 ratings (every user has a history)."""
    genres = lambda i: "|".join("1" if g == i % 19 else "0" for g in range(19))  # noqa: E731
    occupations = ["technician", "writer", "student", "other"]
    (directory / "u.user").write_text("".join(f"{u}|{18 + u}|{'MF'[u % 2]}|{occupations[u % 4]}|{10000 + u}\n" for u in range(1, 21)))
    (directory / "u.item").write_text(
        "".join(f"{i}|Movie {i} (1995)|01-Jan-1995||http://x/{i}|{genres(i)}\n" for i in range(1, 31)), encoding="latin-1"
    )
    (directory / "u.data").write_text("".join(f"{1 + r % 20}\t{1 + (r * 7 + r // 20) % 30}\t{1 + r % 5}\t{880000000 + r // 3}\n" for r in range(400)))


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
    _write_movielens(tmp_path)
    overrides = ["--data.path", str(tmp_path), "--data.global_batch_size", "32", "--data.max_history_length", "8", "--model.init_args.max_history", "8"]
    tested, test_auc = _fit_then_test("movielens_sequence.yaml", overrides, tmp_path)
    assert 0.0 <= test_auc <= 1.0

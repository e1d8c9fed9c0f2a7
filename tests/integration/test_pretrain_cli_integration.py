"""Both pretraining configs end to end through the `lightning-recsys` console script (2 CPU processes,
TwoDRecStrategy): `fit` keeps the best epoch by val/ndcg@10 (its value in the file name) and last.ckpt,
then `test --ckpt_path` on 2 and on 1 process gives the same metrics."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lightning_recsys.testing.commands import run_cli

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
TINY_SYNTHETIC = [
    "--data.init_args.num_users", "192",
    "--data.init_args.num_items", "64",
    "--data.init_args.global_batch_size", "32",
    "--data.init_args.num_negatives", "16",
    "--model.init_args.embedding_dim", "16",
]  # fmt: skip
METRIC = re.compile(r"(test/(?:hr@10|ndcg@10|mrr))\s*│\s*([0-9.]+)")



def _test_metrics(output: str) -> dict[str, float]:
    metrics = {name: float(value) for name, value in METRIC.findall(output)}
    assert set(metrics) == {"test/hr@10", "test/ndcg@10", "test/mrr"}, output[-3000:]
    return metrics


def _fit_then_test(config: str, overrides: list[str], tmp_path: Path, checkpoints: str) -> None:
    fit = run_cli(["fit", "--config", str(CONFIGS / config), "--trainer.max_epochs", "2", *overrides], cwd=tmp_path, world_size=2)
    assert "Run summary" in fit and "TwoDRecStrategy: " in fit
    directory = tmp_path / "checkpoints" / checkpoints
    (best,) = sorted(directory.glob("best-epoch*-ndcg10=*.ckpt"))
    assert (directory / "last.ckpt").is_dir()
    best_ndcg = float(best.name.split("ndcg10=")[1].removesuffix(".ckpt"))
    assert 0.0 <= best_ndcg <= 1.0
    on_two = _test_metrics(run_cli(["test", "--config", str(CONFIGS / config), *overrides, "--ckpt_path", str(best)], cwd=tmp_path, world_size=2))
    on_one = _test_metrics(
        run_cli(["test", "--config", str(CONFIGS / config), *overrides, "--trainer.devices", "1", "--ckpt_path", str(best)], cwd=tmp_path, world_size=1)
    )
    assert on_one == on_two  # exact metrics over every user, whatever the number of processes
    assert 0.0 < on_two["test/mrr"] <= 1.0


@pytest.mark.slow
def test_synthetic_pretrain_config_fits_and_tests_from_its_best_checkpoint(tmp_path):
    _fit_then_test("synthetic_pretrain.yaml", TINY_SYNTHETIC, tmp_path, "synthetic_pretrain")


@pytest.mark.slow
def test_beauty_pretrain_config_fits_and_tests_from_its_best_checkpoint(tmp_path):
    # A small file in the BERT4Rec format: 60 users of 5-9 items over 40 items, each user's lines contiguous.
    lines = []
    for user in range(1, 61):
        lines += [f"{user} {(user * 7 + step * 3) % 40 + 1}" for step in range(5 + user % 5)]
    lines.append("61 40")  # the largest id, so the table has 40 rows; a one-item user is kept out of evaluation
    path = tmp_path / "tiny_beauty.txt"
    path.write_text("\n".join(lines) + "\n")
    overrides = [
        "--data.path", str(path), "--data.num_items", "40", "--data.num_negatives", "16", "--data.global_batch_size", "16",
        "--model.init_args.embedding_dim", "16",
    ]  # fmt: skip
    _fit_then_test("beauty_pretrain.yaml", overrides, tmp_path, "beauty_pretrain")

"""Pre-train -> fine-tune -> test through the `lightning-recsys` console script (2 CPU processes each): the
fine-tune warm-starts a SASRec SequenceRanker from the pretrainer's last.ckpt with
`--trainer.callbacks+=lightning_recsys.callbacks.InitFromCheckpoint --trainer.callbacks.path CKPT`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from lightning_recsys.testing.commands import run_cli

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
ITEMS, DIM, LENGTH = 64, 8, 8
PRETRAIN = [
    "--data.init_args.num_users", "128", "--data.init_args.num_items", str(ITEMS), "--data.init_args.max_length", str(LENGTH),
    "--data.init_args.num_negatives", "16", "--data.init_args.global_batch_size", "32",
    "--model.init_args.num_items", str(ITEMS), "--model.init_args.max_length", str(LENGTH),  # the config's ${data...} resolve first
    "--model.init_args.embedding_dim", str(DIM), "--trainer.max_epochs", "1",
    # No validation: this test follows the weights from fit to fit; the full ranking has its own tests (suite time).
    "--trainer.limit_val_batches", "0",
]  # fmt: skip
# synthetic_sequence.yaml's ranker, switched to the pretrainer's encoder and sizes (its TransAct options back to defaults).
RANKER = [
    "--data.init_args.num_items", str(ITEMS), "--data.init_args.global_batch_size", "64",
    "--data.init_args.train_batches", "3", "--data.init_args.val_batches", "1", "--data.init_args.test_batches", "2",
    "--data.init_args.max_history_length", "12",
    "--model.init_args.item_table_size", str(ITEMS), "--model.init_args.embedding_dim", str(DIM), "--model.init_args.max_history", str(LENGTH),
    "--model.init_args.encoder",  # the pretrainer's encoder and options, in place of the config's TransActEncoder
    '{"class_path": "lightning_recsys.models.encoders.SASRecEncoder", "init_args": {"num_layers": 2, "num_heads": 2, "feedforward_dim": null}}',
    "--model.init_args.newest_tokens", "null", "--model.init_args.action_loss_weight", "0", "--model.init_args.positive_actions", "null",
]  # fmt: skip



@pytest.mark.slow
def test_pretrain_then_fine_tune_with_a_warm_start_then_test(tmp_path):
    run_cli(["fit", "--config", str(CONFIGS / "synthetic_pretrain.yaml"), *PRETRAIN], cwd=tmp_path, world_size=2)
    pretrained = tmp_path / "checkpoints" / "synthetic_pretrain" / "last.ckpt"
    assert pretrained.exists()
    ranker = ["--config", str(CONFIGS / "synthetic_sequence.yaml"), *RANKER]
    warm = [
        "--trainer.callbacks+=lightning_recsys.callbacks.InitFromCheckpoint", "--trainer.callbacks.path", str(pretrained),
        "--trainer.callbacks.parts", "[encoder, item_table]",  # by role: the checkpoint recorded where its model holds them
    ]  # fmt: skip
    fit = run_cli(["fit", *ranker, "--trainer.max_epochs", "1", "--trainer.enable_checkpointing", "true", *warm], cwd=tmp_path, world_size=2)
    # The item table and the encoder: the pretrainer has no action table (its num_action_types is 0).
    match = re.search(r"InitFromCheckpoint: loaded (\d+) tensors from (\S+)", fit)
    assert match, fit[-3000:]
    assert int(match.group(1)) == 1 + 1 + 2 * 12 + 2  # item table, positions, 12 tensors per SASRec block, final norm
    (checkpoint,) = sorted(tmp_path.glob("lightning_logs/version_*/checkpoints/*.ckpt"))
    tested = run_cli(["test", *ranker, "--ckpt_path", str(checkpoint)], cwd=tmp_path, world_size=2)
    assert "Loaded model weights from the checkpoint" in tested and "InitFromCheckpoint" not in tested
    auc = re.search(r"test/auc\s*│\s*([0-9.]+)", tested)
    assert auc and 0.0 <= float(auc.group(1)) <= 1.0, tested[-3000:]

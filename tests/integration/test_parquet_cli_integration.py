"""examples/configs/parquet_pretrain.yaml end to end through the `lightning-recsys` console script on a tiny
generated prepared directory (2 CPU processes): fit with num_items and max_length linked from the data, then
predict writes one embedding shard per rank covering every user once."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from lightning_recsys.testing.commands import run_cli

from lightning_recsys.data.parquet.writing import PreparedWriter

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "configs" / "parquet_pretrain.yaml")
NUM_USERS, NUM_ITEMS = 300, 70
TINY = [
    "--data.path", "prepared",
    "--data.init_args.global_batch_size", "32",
    "--data.init_args.num_negatives", "16",
    "--data.init_args.max_length", "12",
    "--model.init_args.embedding_dim", "16",
    "--model.init_args.predict_top_k", "5",
]  # fmt: skip



@pytest.mark.slow
def test_parquet_pretrain_config_fits_then_predicts_embeddings_of_every_user(tmp_path):
    rng = np.random.default_rng(0)
    writer = PreparedWriter(tmp_path / "prepared", NUM_ITEMS, groups_per_file=2)
    for group in range(3):
        lengths = rng.integers(1, 20, size=NUM_USERS // 3)
        first = group * (NUM_USERS // 3)
        writer.write_group(np.arange(first, first + len(lengths)), lengths, rng.integers(0, NUM_ITEMS, size=int(lengths.sum())))
    writer.close()
    fit = run_cli(["fit", "--config", CONFIG, "--trainer.max_epochs", "1", *TINY], cwd=tmp_path, world_size=2)
    assert "val/ndcg@10" in fit
    assert (tmp_path / "checkpoints" / "parquet_pretrain" / "last.ckpt").is_dir()
    last = str(tmp_path / "checkpoints" / "parquet_pretrain" / "last.ckpt")
    run_cli(["predict", "--config", CONFIG, *TINY, "--ckpt_path", last, "--return_predictions", "false"], cwd=tmp_path, world_size=2)
    shards = sorted((tmp_path / "embeddings" / "parquet_pretrain").glob("*.parquet"))
    assert [s.name for s in shards] == ["embeddings-00000-of-00002.parquet", "embeddings-00001-of-00002.parquet"]
    tables = [pq.read_table(s) for s in shards]
    assert sorted(u for t in tables for u in t.column("user_id").to_pylist()) == list(range(NUM_USERS))
    assert tables[0].schema.field("user_vector").type.list_size == 16
    assert tables[0].schema.field("top_k_item_ids").type.list_size == 5

"""``UserEmbeddingWriter``: ``predict`` over every user streams one parquet shard per rank, batch by batch.

Each row is one user: ``user_id`` (the prepared directory's id, int64 or string), ``user_vector``
(``fixed_size_list<float32>[D]``), and, when the model returns them (``SequencePretrainer(predict_top_k=K)``),
``top_k_rows`` (item table rows), ``top_k_item_ids`` (the raw item ids of ``items.parquet``; null
for the shared out-of-vocabulary row) and ``top_k_scores``, best first.

Memory: each batch is written as it comes (a ``ParquetWriter`` row group per ``rows_per_group``
users), so the writer holds at most ``rows_per_group`` users plus the row-to-raw-id map of the item
table. Run ``trainer.predict(..., return_predictions=False)``, or Lightning keeps every batch's
output in memory as well.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter

from lightning_recsys.data.parquet.contract import ITEM_ID_COLUMN, ITEMS_FILE, ROW_COLUMN


def shard_name(rank: int, world_size: int) -> str:
    return f"embeddings-{rank:05d}-of-{world_size:05d}.parquet"


class UserEmbeddingWriter(BasePredictionWriter):
    """Writes ``output_dir/embeddings-RRRRR-of-WWWWW.parquet`` on each rank during ``predict`` (see the module docstring).

    Args:
        output_dir: created if missing. A shard appears under its final name only once the rank's
            predict loop ends; until then it is ``<name>.tmp``.
        top_k: write the model's top-K items and scores when its predict output has them.
        rows_per_group: users per parquet row group (the writer's buffer), >= 1.
    """

    def __init__(self, output_dir: str, top_k: bool = True, rows_per_group: int = 65536) -> None:
        super().__init__(write_interval="batch")
        if not str(output_dir):
            raise ValueError(f"output_dir={output_dir!r} must name a directory for the embedding shards.")
        if isinstance(rows_per_group, bool) or not isinstance(rows_per_group, int) or rows_per_group < 1:
            raise ValueError(f"rows_per_group={rows_per_group!r} must be an integer >= 1.")
        self.output_dir, self.top_k, self.rows_per_group = Path(output_dir), top_k, rows_per_group
        self._writer: pq.ParquetWriter | None = None
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._path: Path | None = None
        self._raw_ids: pa.Array | None = None
        self.rows_written = 0

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close(commit=False)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._path = self.output_dir / shard_name(trainer.global_rank, trainer.world_size)
        self.rows_written = 0
        self._raw_ids = _raw_item_ids(getattr(trainer, "datamodule", None))

    def write_on_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, prediction: Any, batch_indices: Any, batch: Any, batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        user_ids = getattr(batch, "user_ids", None)
        if user_ids is None:
            raise ValueError(
                f"UserEmbeddingWriter: predict batch {batch_idx} ({type(batch).__name__}) names no users; predict with a "
                "DataModule whose batches carry user_ids (SequenceParquetDataModule's UserSequenceBatch)."
            )
        if not isinstance(prediction, dict) or "user_vectors" not in prediction:
            raise ValueError(
                f"UserEmbeddingWriter: the model's predict output is {type(prediction).__name__}, without 'user_vectors'; "
                "predict with a SequencePretrainer (its predict_step returns {'user_vectors': ...})."
            )
        vectors = prediction["user_vectors"].detach().float().cpu().numpy()
        if len(vectors) != len(user_ids):
            raise ValueError(f"UserEmbeddingWriter: batch {batch_idx} has {len(user_ids)} users but {len(vectors)} vectors.")
        dim = vectors.shape[1]
        columns: dict[str, pa.Array] = {
            "user_id": pa.array(user_ids),
            "user_vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dim),
        }
        if self.top_k and "top_k_ids" in prediction:
            rows = prediction["top_k_ids"].detach().cpu().numpy().astype(np.int64)
            scores = prediction["top_k_scores"].detach().float().cpu().numpy()
            k = rows.shape[1]
            columns["top_k_rows"] = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), k)
            if self._raw_ids is not None:
                raw = self._raw_ids.take(pa.array(rows.reshape(-1)))
                columns["top_k_item_ids"] = pa.FixedSizeListArray.from_arrays(raw, k)
            columns["top_k_scores"] = pa.FixedSizeListArray.from_arrays(pa.array(scores.reshape(-1), pa.float32()), k)
        self._pending.append(pa.table(columns))
        self._pending_rows += len(user_ids)
        if self._pending_rows >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        table = pa.concat_tables(self._pending)
        self._pending, self._pending_rows = [], 0
        if self._writer is None:
            assert self._path is not None
            self._writer = pq.ParquetWriter(self._tmp(), table.schema)
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        self.rows_written += table.num_rows

    def _tmp(self) -> Path:
        assert self._path is not None
        return self._path.with_name(self._path.name + ".tmp")

    def _close(self, *, commit: bool) -> None:
        if commit:
            self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            if commit:
                os.replace(self._tmp(), self._path)  # type: ignore[arg-type]
        self._pending, self._pending_rows = [], 0

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close(commit=True)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close(commit=False)  # a predict loop that failed leaves only its .tmp shard


def _raw_item_ids(datamodule: Any) -> pa.Array | None:
    """Row -> raw item id of a prepared directory's ``items.parquet`` (null for rows it does not list), or None."""
    path = getattr(datamodule, "path", None)
    meta = getattr(datamodule, "metadata", None)
    if path is None or meta is None or not (Path(path) / ITEMS_FILE).is_file():
        return None
    table = pq.read_table(Path(path) / ITEMS_FILE, columns=[ITEM_ID_COLUMN, ROW_COLUMN])
    rows = table.column(ROW_COLUMN).to_numpy()
    slots = np.full(meta.num_items, len(rows), dtype=np.int64)  # len(rows): a null appended below
    slots[rows] = np.arange(len(rows))
    ids = table.column(ITEM_ID_COLUMN).combine_chunks()
    with_null = pa.concat_arrays([ids, pa.nulls(1, ids.type)])
    return with_null.take(pa.array(slots))

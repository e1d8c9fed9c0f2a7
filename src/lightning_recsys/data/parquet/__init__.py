"""Prepared parquet user sequences: the contract (``contract``), ``prepare`` (raw events in, the contract out) and the readers.

``lightning-recsys prepare --input EVENTS --output DIR`` writes a prepared directory; see
``docs/datasets.md`` ("Prepared parquet data (contract v1)").
"""

from __future__ import annotations

from lightning_recsys.data.parquet.contract import (
    ACTIONS_COLUMN,
    COUNT_COLUMN,
    FORMAT,
    ITEM_ID_COLUMN,
    ITEM_ROWS_COLUMN,
    ITEMS_FILE,
    METADATA_FILE,
    ROW_COLUMN,
    TIMESTAMPS_COLUMN,
    USER_ID_COLUMN,
    USERS_DIR,
    VERSION,
    FileInfo,
    PreparedBy,
    PreparedDataError,
    PreparedMetadata,
    RowGroupInfo,
    RowGroupRef,
    part_file_name,
    read_metadata,
    write_metadata,
)
from lightning_recsys.data.parquet.describe import describe_directory as describe
from lightning_recsys.data.parquet.prepare import PrepareConfig, prepare  # DuckDB itself is imported on use
from lightning_recsys.data.parquet.prepare_sql import PrepareError
from lightning_recsys.data.parquet.synthetic_events import SyntheticEventsConfig, generate_events

__all__ = [
    "ACTIONS_COLUMN",
    "COUNT_COLUMN",
    "FORMAT",
    "ITEMS_FILE",
    "ITEM_ID_COLUMN",
    "ITEM_ROWS_COLUMN",
    "METADATA_FILE",
    "ROW_COLUMN",
    "TIMESTAMPS_COLUMN",
    "USERS_DIR",
    "USER_ID_COLUMN",
    "VERSION",
    "FileInfo",
    "PreparedBy",
    "PreparedDataError",
    "PrepareConfig",
    "PrepareError",
    "PreparedMetadata",
    "RowGroupInfo",
    "RowGroupRef",
    "SyntheticEventsConfig",
    "describe",
    "generate_events",
    "part_file_name",
    "prepare",
    "read_metadata",
    "write_metadata",
]

# ---- DataModule / reader exports (owned by the reader's author; append below this line) ----
from lightning_recsys.data.parquet.embedding_writer import UserEmbeddingWriter  # noqa: E402
from lightning_recsys.data.parquet.module import SequenceParquetDataModule  # noqa: E402
from lightning_recsys.data.parquet.ranking import SequenceParquetRankingDataModule  # noqa: E402
from lightning_recsys.data.parquet.reader import PreparedReader, open_prepared, plan_rank  # noqa: E402
from lightning_recsys.data.parquet.streams import UserSequenceBatch  # noqa: E402
from lightning_recsys.data.parquet.writing import PreparedWriter  # noqa: E402

__all__ += [
    "PreparedReader",
    "PreparedWriter",
    "SequenceParquetDataModule",
    "SequenceParquetRankingDataModule",
    "UserEmbeddingWriter",
    "UserSequenceBatch",
    "open_prepared",
    "plan_rank",
]
# ---- end of DataModule / reader exports ----

"""Prepared parquet user sequences: the contract (``contract``), ``prepare`` (raw events in, the contract out) and the readers.

``lightning-recsys prepare --input EVENTS --output DIR`` writes a prepared directory; see
``docs/datasets.md`` ("Prepared parquet data (contract v1)").
"""

from __future__ import annotations

from lightning_recsys._lazy import lazy_exports
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
from lightning_recsys.data.parquet.writing import PreparedWriter

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

# The DataModules and the reader need torch; imported on first use, so that `lightning-recsys prepare` does not.
_EXPORTS = {
    "PreparedReader": "lightning_recsys.data.parquet.reader",
    "SequenceParquetDataModule": "lightning_recsys.data.parquet.module",
    "SequenceParquetRankingDataModule": "lightning_recsys.data.parquet.ranking",
    "UserEmbeddingWriter": "lightning_recsys.data.parquet.embedding_writer",
    "UserSequenceBatch": "lightning_recsys.data.parquet.streams",
    "open_prepared": "lightning_recsys.data.parquet.reader",
    "plan_rank": "lightning_recsys.data.parquet.reader",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ += ["PreparedWriter", *_EXPORTS]

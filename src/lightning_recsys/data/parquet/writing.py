"""``PreparedWriter``: write a prepared directory (contract v1) from per-user sequences already in item rows.

For data that is already grouped per user and mapped to item rows (generated data, tests, another
pipeline's output): row group by row group, in bounded memory. Raw events go through
``lightning-recsys prepare`` instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lightning_recsys.data.parquet.contract import (
    ACTIONS_COLUMN,
    COUNT_COLUMN,
    ITEM_ID_COLUMN,
    ITEM_ROWS_COLUMN,
    ITEMS_FILE,
    ROW_COLUMN,
    USER_FILE_WRITE_OPTIONS,
    USER_ID_COLUMN,
    USERS_DIR,
    FileInfo,
    PreparedBy,
    PreparedMetadata,
    RowGroupInfo,
    part_file_name,
    write_metadata,
)

_TOOL = "lightning_recsys.data.parquet.writing.PreparedWriter"


class PreparedWriter:
    """Writes ``users/part-NNNNN.parquet`` files one row group at a time, then ``items.parquet`` and ``metadata.json``.

    Args:
        directory: created if missing; must not hold a prepared directory already.
        num_items: rows of the item table (every item row is in ``[0, num_items)``).
        num_action_types: > 0 to write an ``actions`` column.
        groups_per_file: row groups per user file before the next file starts.
        item_type: ``pa.int32()`` or ``pa.int64()``, the type of ``item_rows``' values.
    """

    def __init__(
        self, directory: str | os.PathLike[str], num_items: int, *, num_action_types: int = 0, groups_per_file: int = 8,
        item_type: pa.DataType = pa.int32(), compression: str = "zstd",
    ) -> None:
        if num_items < 1:
            raise ValueError(f"num_items={num_items} must be >= 1.")
        if groups_per_file < 1:
            raise ValueError(f"groups_per_file={groups_per_file} must be >= 1.")
        self.directory = Path(directory)
        (self.directory / USERS_DIR).mkdir(parents=True, exist_ok=True)
        self.num_items, self.num_action_types, self.groups_per_file = num_items, num_action_types, groups_per_file
        self.item_type, self.compression = item_type, compression
        self.counts = np.zeros(num_items, dtype=np.int64)
        self.files: list[FileInfo] = []
        self._groups: list[RowGroupInfo] = []
        self._writer: pq.ParquetWriter | None = None
        self._user_type: str | None = None

    def write_group(self, user_ids: np.ndarray | list, lengths: np.ndarray, items: np.ndarray, actions: np.ndarray | None = None) -> None:
        """One row group: users ``user_ids`` with ``lengths[u]`` events each, ``items`` (and ``actions``) concatenated, oldest first."""
        lengths = np.asarray(lengths, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32 if len(items) < 2**31 else np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = pa.array(user_ids)
        user_type = "string" if pa.types.is_string(ids.type) else "int64"
        if self._user_type is not None and user_type != self._user_type:
            raise ValueError(f"user ids switched from {self._user_type} to {user_type} between row groups.")
        self._user_type = user_type
        columns = {
            USER_ID_COLUMN: ids.cast(pa.int64()) if user_type == "int64" else ids,
            ITEM_ROWS_COLUMN: _list_array(offsets, np.asarray(items), self.item_type),
        }
        if self.num_action_types:
            if actions is None:
                raise ValueError(f"num_action_types={self.num_action_types} needs actions for every row group.")
            columns[ACTIONS_COLUMN] = _list_array(offsets, np.asarray(actions), pa.int32())
        table = pa.table(columns)
        if self._writer is None:
            path = self.directory / part_file_name(len(self.files))
            self._writer = pq.ParquetWriter(path, table.schema, compression=self.compression, **USER_FILE_WRITE_OPTIONS)
        self._writer.write_table(table, row_group_size=max(1, len(lengths)))
        self.counts += np.bincount(np.asarray(items, dtype=np.int64), minlength=self.num_items)
        short = tuple(int((lengths == n).sum()) for n in (1, 2, 3))
        self._groups.append(RowGroupInfo(len(lengths), int(lengths.sum()), short))  # type: ignore[arg-type]
        if len(self._groups) >= self.groups_per_file:
            self._close_file()

    def _close_file(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._writer = None
        path = part_file_name(len(self.files))
        rows, events = sum(g.num_rows for g in self._groups), sum(g.num_events for g in self._groups)
        self.files.append(FileInfo(path, rows, events, tuple(self._groups)))
        self._groups = []

    def close(self) -> PreparedMetadata:
        """Finish the last file, write ``items.parquet`` and ``metadata.json``; returns the metadata.

        The items are already rows here, so ``items.parquet`` maps raw id ``r`` to row ``r`` (not
        reordered by frequency as ``prepare`` does)."""
        self._close_file()
        rows = pa.array(np.arange(self.num_items, dtype=np.int64))
        pq.write_table(pa.table({ITEM_ID_COLUMN: rows, ROW_COLUMN: rows, COUNT_COLUMN: pa.array(self.counts)}), self.directory / ITEMS_FILE)
        metadata = PreparedMetadata(
            num_items=self.num_items, oov_row=None, oov_items=0, oov_events=0,
            num_users=sum(f.num_rows for f in self.files), num_events=sum(f.num_events for f in self.files),
            users_with_one_event=sum(g.short_users[0] for f in self.files for g in f.row_groups),
            num_action_types=self.num_action_types, user_id_type=self._user_type or "int64",
            has_actions=self.num_action_types > 0, has_timestamps=False, files=tuple(self.files),
            prepared_by=PreparedBy(tool=_TOOL, package_version="", input_format="item rows"),
        )
        write_metadata(self.directory, metadata)
        return metadata


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    kind = pa.ListArray if offsets.dtype == np.int32 else pa.LargeListArray
    return kind.from_arrays(pa.array(offsets), pa.array(values).cast(value_type))

"""The Python half of ``prepare``: group a stream of events sorted by user into per-user rows and write them.

``UserFileWriter`` takes Arrow batches of ``(user, row, [action], [ts])`` sorted by user, turns
each run of one user into a row with list columns (vectorized: one comparison of neighbouring
user ids per batch), and writes row groups of about ``row_group_events`` events and files of
about ``file_events`` events. It holds at most one row group plus one batch (and one user's
history), whatever the size of the data.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lightning_recsys.data.parquet.contract import (
    ACTIONS_COLUMN,
    ITEM_ROWS_COLUMN,
    TIMESTAMPS_COLUMN,
    USER_FILE_WRITE_OPTIONS,
    USER_ID_COLUMN,
    FileInfo,
    RowGroupInfo,
    part_file_name,
)


def user_schema(user_type: str, has_actions: bool, has_timestamps: bool) -> pa.Schema:
    """The user files' schema: item rows as int32 (the contract lets writers choose int32 or int64)."""
    fields = [
        pa.field(USER_ID_COLUMN, pa.int64() if user_type == "int64" else pa.string(), nullable=False),
        pa.field(ITEM_ROWS_COLUMN, pa.list_(pa.int32()), nullable=False),
    ]
    if has_actions:
        fields.append(pa.field(ACTIONS_COLUMN, pa.list_(pa.int32()), nullable=False))
    if has_timestamps:
        fields.append(pa.field(TIMESTAMPS_COLUMN, pa.list_(pa.int64()), nullable=False))
    return pa.schema(fields)


class UserFileWriter:
    """Writes ``users/part-NNNNN.parquet`` files from event batches sorted by user (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        schema: pa.Schema,
        row_group_events: int,
        file_events: int,
        compression: str = "zstd",
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.directory, self.schema = directory, schema
        self.row_group_events, self.file_events, self.compression = row_group_events, file_events, compression
        self.progress = progress
        self.files: list[FileInfo] = []
        self._carry: pa.RecordBatch | None = None  # the last user of the previous batch, maybe unfinished
        self._pending: list[pa.Table] = []  # finished users not yet in a row group
        self._pending_events = 0
        self._writer: pq.ParquetWriter | None = None
        self._groups: list[RowGroupInfo] = []
        self._events_written = 0

    def add_events(self, batch: pa.RecordBatch) -> None:
        """One batch of sorted events (columns ``user``, ``row``, optionally ``action``, ``ts``)."""
        if batch.num_rows == 0:
            return
        if self._carry is not None:
            batch = pa.Table.from_batches([self._carry, batch]).combine_chunks().to_batches()[0]
            self._carry = None
        users = batch.column("user")
        # A new user starts where the id differs from the previous event's.
        changed = pc.not_equal(users.slice(1), users.slice(0, len(users) - 1)).to_numpy(zero_copy_only=False)
        starts = np.concatenate(([0], np.flatnonzero(changed) + 1))
        # The last run may continue in the next batch: carry it.
        last = int(starts[-1])
        self._carry = batch.slice(last)
        if last > 0:
            self._add_users(batch.slice(0, last), starts[:-1], last)

    def _add_users(self, events: pa.RecordBatch, starts: np.ndarray, stop: int) -> None:
        offsets = pa.array(np.concatenate((starts, [stop])).astype(np.int32))
        columns = [events.column("user").take(pa.array(starts))]
        columns.append(pa.ListArray.from_arrays(offsets, events.column("row").cast(pa.int32())))
        if ACTIONS_COLUMN in self.schema.names:
            columns.append(pa.ListArray.from_arrays(offsets, events.column("action").cast(pa.int32())))
        if TIMESTAMPS_COLUMN in self.schema.names:
            columns.append(pa.ListArray.from_arrays(offsets, events.column("ts").cast(pa.int64())))
        table = pa.Table.from_arrays(columns, schema=self.schema)
        self._pending.append(table)
        self._pending_events += stop
        if self._pending_events >= self.row_group_events:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        """Write the pending users as row groups closed at cumulative ``row_group_events`` events."""
        if not self._pending:
            return
        table = pa.concat_tables(self._pending).combine_chunks()
        self._pending, self._pending_events = [], 0
        lengths = pc.list_value_length(table.column(ITEM_ROWS_COLUMN)).to_numpy(zero_copy_only=False).astype(np.int64)
        cumulative = np.cumsum(lengths)
        start = 0
        while start < len(lengths):
            base = cumulative[start - 1] if start else 0
            # The first row that brings the group to row_group_events events closes it.
            stop = int(np.searchsorted(cumulative, base + self.row_group_events, side="left")) + 1
            if stop > len(lengths):
                if not final:
                    break  # not a full group yet: keep it pending
                stop = len(lengths)
            self._write_group(table.slice(start, stop - start), lengths[start:stop])
            start = stop
        if start < len(lengths):
            rest = table.slice(start)
            self._pending, self._pending_events = [rest], int(lengths[start:].sum())

    def _write_group(self, table: pa.Table, lengths: np.ndarray) -> None:
        if self._writer is None:
            path = self.directory / part_file_name(len(self.files))
            path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(str(path), self.schema, compression=self.compression, **USER_FILE_WRITE_OPTIONS)
            self._file_start = time.perf_counter()
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        events = int(lengths.sum())
        short = tuple(int(np.count_nonzero(lengths == n)) for n in (1, 2, 3))
        self._groups.append(RowGroupInfo(table.num_rows, events, (short[0], short[1], short[2])))
        self._events_written += events
        if self.progress is not None:
            self.progress(self._events_written)
        if sum(group.num_events for group in self._groups) >= self.file_events:
            self._close_file()

    def _close_file(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        groups = tuple(self._groups)
        self.files.append(
            FileInfo(part_file_name(len(self.files)), sum(g.num_rows for g in groups), sum(g.num_events for g in groups), groups)
        )
        self._writer, self._groups = None, []

    def close(self) -> list[FileInfo]:
        """Write what is left (the last user, the last row group) and return the files written, in order."""
        if self._carry is not None and self._carry.num_rows:
            carry, self._carry = self._carry, None
            self._add_users(carry, np.array([0]), carry.num_rows)
        self._flush(final=True)
        self._close_file()
        return self.files

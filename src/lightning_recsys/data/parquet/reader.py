"""Reading one rank's users of a prepared directory: the plan from metadata, then only the row groups it needs.

Planning (``plan_rank``) uses ``metadata.json`` alone: rank ``r`` of ``W`` takes the users
``rank_range(num_users, r, W)`` of the global user order (file order, then row order), cut into
``Segment``s, each a row slice of one row group. Reading (``PreparedReader.read``) reads a file's
footer (exactly its bytes) the first time one of its segments is read, and then only that row
group's needed columns; every byte taken from disk is counted in ``bytes_read``. A segment that ends
before its row group does stops reading after the pages that hold its rows. A rank thus reads its
own rows, one footer per file, all of the row group whose tail it shares with the rank before it,
and a page or so past its last row in the one whose head it shares with the rank after it (with the
small pages of ``USER_FILE_WRITE_OPTIONS``).

What is checked, raising ``PreparedDataError`` that names the file, and the row group and row where
they are known:

- opening: the file exists and is parquet (magic bytes, a readable footer); its schema has
  ``user_id`` of the metadata's ``user_id_type``, ``item_rows`` as a list of int32/int64, and
  ``actions`` (a list of integers) where the metadata says there are actions, and ``timestamps``
  (a list of int64) where it says there are timestamps and they are read; its row groups and their
  row counts are those ``metadata.json`` lists;
- reading a segment: the row group decodes (a truncated or corrupt file fails here); no user's
  list is null or empty; no item row is null, negative or ``>= num_items``; ``actions`` has the
  same length as ``item_rows`` in every row and values in ``[0, num_action_types)``; ``timestamps``
  has the same length as ``item_rows``, no null, and never decreases within a row (oldest first); a whole row
  group's events equal the metadata's count; and **no user id appears twice in the rows read from
  one row group**. Duplicates across row groups or files are not detected by the reader (it keeps
  no set of every id, which would grow with the data); ``prepare`` writes each user once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lightning_recsys.data.parquet.contract import (
    ACTIONS_COLUMN,
    ITEM_ROWS_COLUMN,
    METADATA_FILE,
    TIMESTAMPS_COLUMN,
    USER_ID_COLUMN,
    PreparedDataError,
    PreparedMetadata,
    read_metadata,
)
from lightning_recsys.data.ranks import rank_range
from lightning_recsys.data.sequences import UserSequences

_MAX_OPEN_FILES = 4  # footers kept open; a rank walks its files in order, so a few suffice
_MAX_CACHED_FOOTERS = 1024  # about 5 MiB of footers of 16 row groups: every file of a rank's 10^9 events, and no more at 10^11
_STREAM_BUFFER_BYTES = 16 * 1024  # at most half a page (USER_FILE_WRITE_OPTIONS) read ahead per column


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of one row group: the part of it one rank (or one worker) reads."""

    file_index: int
    path: str  # relative to the directory
    row_group: int
    first_user: int  # global index of the row group's first row
    start: int
    stop: int
    group_rows: int
    group_events: int
    short_users: tuple[int, int, int]  # of the whole row group

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.group_rows

    def where(self) -> str:
        return f"{self.path}, row group {self.row_group}"


def plan_rank(metadata: PreparedMetadata, rank: int, world_size: int) -> list[Segment]:
    """Rank ``rank``'s users (``rank_range`` of the global order) as row-group segments, in order."""
    lo, hi = rank_range(metadata.num_users, rank, world_size)
    segments = []
    for ref in metadata.row_groups_holding(lo, hi):
        start, stop = max(lo, ref.first_user), min(hi, ref.first_user + ref.num_rows)
        if start < stop:
            segments.append(Segment(
                ref.file_index, ref.path, ref.row_group, ref.first_user, start - ref.first_user, stop - ref.first_user,
                ref.num_rows, ref.num_events, ref.short_users,
            ))
    return segments


@dataclass
class UserChunk:
    """The users of one segment: their sequences (``user_ids`` as int64, or object for string ids) and where they are."""

    sequences: UserSequences
    segment: Segment

    @property
    def first_user(self) -> int:
        return self.segment.first_user + self.segment.start


class ByteCounter:
    """Bytes read from disk (``value``) and events decoded (``events``) by the readers that share it."""

    def __init__(self) -> None:
        self.value = 0
        self.events = 0


class _CountingFile(io.FileIO):
    """A file whose reads add to a ``ByteCounter``: what pyarrow really took from disk."""

    def __init__(self, path: str, counter: ByteCounter) -> None:
        super().__init__(path, "rb")
        self._counter = counter

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        self._counter.value += len(data)
        return data

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        count = super().readinto(buffer)
        self._counter.value += count or 0
        return count  # type: ignore[return-value]

    def readall(self) -> bytes:
        data = super().readall()
        self._counter.value += len(data)
        return data


def open_prepared(directory: str | os.PathLike[str]) -> PreparedMetadata:
    """``read_metadata`` with one more clear case: an empty (or missing) directory."""
    path = Path(directory)
    if path.is_dir() and not any(path.iterdir()):
        raise PreparedDataError(
            f"{path}: the directory is empty; a prepared directory holds {METADATA_FILE}, items.parquet and users/ "
            "(write one with `lightning-recsys prepare`)."
        )
    return read_metadata(path)


class PreparedReader:
    """Reads segments of one prepared directory, validating as it goes (see the module docstring).

    ``with_user_ids``: convert the user ids to numpy (evaluation and predict need them; training
    checks them for duplicates in arrow and never converts them). ``timestamps``: read the
    ``timestamps`` column where the metadata says the files have it (``with_timestamps``); False
    leaves it unread (no bytes, no checks) and the sequences without times.
    """

    def __init__(
        self, directory: str | os.PathLike[str], metadata: PreparedMetadata, *, with_user_ids: bool = True,
        counter: ByteCounter | None = None, timestamps: bool = True,
    ) -> None:
        self.directory, self.metadata, self.with_user_ids = Path(directory), metadata, with_user_ids
        self.with_timestamps = bool(timestamps and metadata.has_timestamps)
        self.counter = counter if counter is not None else ByteCounter()
        self._files: dict[str, tuple[pq.ParquetFile, _CountingFile]] = {}
        # The footers read, newest last (a few KiB each; parsed, one takes about ten times that): a file opened
        # again (the shuffled order revisits files) parses its footer again instead of reading it. At most
        # _MAX_CACHED_FOOTERS, so that memory does not grow with the files a rank reads.
        self._footers: OrderedDict[str, bytes] = OrderedDict()
        self._columns = [USER_ID_COLUMN, ITEM_ROWS_COLUMN] + ([ACTIONS_COLUMN] if metadata.has_actions else [])
        self._columns += [TIMESTAMPS_COLUMN] if self.with_timestamps else []

    @property
    def bytes_read(self) -> int:
        return self.counter.value

    def close(self) -> None:
        for _, handle in self._files.values():
            handle.close()
        self._files.clear()

    def __getstate__(self) -> dict:  # open files stay behind when a worker process gets a copy
        state = dict(self.__dict__)
        state["_files"], state["_footers"] = {}, OrderedDict()
        return state

    def _open(self, segment: Segment) -> pq.ParquetFile:
        if segment.path in self._files:
            return self._files[segment.path][0]
        if len(self._files) >= _MAX_OPEN_FILES:
            oldest = next(iter(self._files))
            self._files.pop(oldest)[1].close()
        full = self.directory / segment.path
        if not full.is_file():
            raise PreparedDataError(f"{full}: listed in {METADATA_FILE} (files[{segment.file_index}]) but missing.")
        handle = _CountingFile(str(full), self.counter)
        footer = self._footers.get(segment.path)
        if footer is not None:
            self._footers.move_to_end(segment.path)
        try:
            raw = footer if footer is not None else _read_footer(handle)
            # Buffered column streams, not whole column chunks (buffer_size=0 reads each chunk at once): a head
            # segment then takes only its pages from disk.
            parquet = pq.ParquetFile(handle, metadata=_parse_footer(raw), buffer_size=_STREAM_BUFFER_BYTES, pre_buffer=False)
        except (pa.ArrowException, OSError, ValueError) as error:
            handle.close()
            raise PreparedDataError(f"{full}: not a readable parquet file (not parquet, or truncated): {error}") from None
        if footer is None:
            try:
                self._check_file(parquet, segment, str(full))
            except PreparedDataError:
                handle.close()
                raise
            self._footers[segment.path] = raw
            if len(self._footers) > _MAX_CACHED_FOOTERS:
                self._footers.popitem(last=False)
        self._files[segment.path] = (parquet, handle)
        return parquet

    def _check_file(self, parquet: pq.ParquetFile, segment: Segment, name: str) -> None:
        schema = parquet.schema_arrow
        for column in self._columns:
            if schema.get_field_index(column) < 0:
                raise PreparedDataError(f"{name}: column {column!r} is missing (the file has {schema.names}).")
        user_type = schema.field(USER_ID_COLUMN).type
        wanted_string = self.metadata.user_id_type == "string"
        if (wanted_string and not (pa.types.is_string(user_type) or pa.types.is_large_string(user_type))) or (
            not wanted_string and not pa.types.is_integer(user_type)
        ):
            raise PreparedDataError(
                f"{name}: column 'user_id' is {user_type}, but {METADATA_FILE} says user_id_type={self.metadata.user_id_type!r}."
            )
        _check_list(schema, ITEM_ROWS_COLUMN, name, (pa.int32(), pa.int64()))
        if self.metadata.has_actions:
            _check_list(schema, ACTIONS_COLUMN, name, None)
        if self.with_timestamps:
            _check_list(schema, TIMESTAMPS_COLUMN, name, (pa.int64(),))
        info = self.metadata.files[segment.file_index]
        stated = [group.num_rows for group in info.row_groups]
        actual = [parquet.metadata.row_group(i).num_rows for i in range(parquet.metadata.num_row_groups)]
        if stated != actual:
            raise PreparedDataError(
                f"{name}: {METADATA_FILE} lists {len(stated)} row groups with {sum(stated)} rows "
                f"({_short_list(stated)}) but the file has {len(actual)} with {sum(actual)} ({_short_list(actual)}); "
                "the metadata does not describe this file. Prepare the directory again (or rerun describe)."
            )

    def read(self, segment: Segment) -> UserChunk:
        """The users of ``segment``, validated; ``items`` int64, trimmed to nothing else."""
        _release_freed_memory()
        parquet = self._open(segment)
        name = str(self.directory / segment.path)
        try:
            if segment.stop < segment.group_rows:
                table = self._read_head(parquet, segment)
            else:
                table = parquet.read_row_group(segment.row_group, columns=self._columns)
        except (pa.ArrowException, OSError) as error:
            raise PreparedDataError(f"{name}, row group {segment.row_group}: cannot be read (truncated or corrupt): {error}") from None
        if not segment.whole:
            table = table.slice(segment.start, segment.num_rows)
        return self._chunk(table, segment, name)

    def _read_head(self, parquet: pq.ParquetFile, segment: Segment) -> pa.Table:
        """Rows ``[0, stop)`` of the row group, stopping after the pages that hold them (the rest stays unread)."""
        batches, rows = [], 0
        for batch in parquet.iter_batches(segment.stop, row_groups=[segment.row_group], columns=self._columns, use_threads=False):
            batches.append(batch)
            rows += batch.num_rows
            if rows >= segment.stop:
                break
        schema = pa.schema([parquet.schema_arrow.field(column) for column in self._columns])
        return pa.Table.from_batches(batches, schema=schema).slice(0, segment.stop)

    def _chunk(self, table: pa.Table, segment: Segment, name: str) -> UserChunk:
        where = f"{name}, row group {segment.row_group}"
        users = _one_chunk(table.column(USER_ID_COLUMN))
        if users.null_count:
            row = int(np.flatnonzero(users.is_null().to_numpy(zero_copy_only=False))[0])
            raise PreparedDataError(f"{where}, row {segment.start + row}: user_id is null.")
        if len(pc.unique(users)) != len(users):
            _raise_duplicate(users, segment, where)
        items_list = _one_chunk(table.column(ITEM_ROWS_COLUMN))
        if items_list.null_count:
            row = int(np.flatnonzero(items_list.is_null().to_numpy(zero_copy_only=False))[0])
            raise PreparedDataError(f"{where}, row {segment.start + row}: item_rows is null (every user has >= 1 event).")
        lengths = items_list.value_lengths().to_numpy().astype(np.int64, copy=False)
        if len(lengths) and lengths.min() < 1:
            row = int(np.flatnonzero(lengths < 1)[0])
            raise PreparedDataError(f"{where}, row {segment.start + row}: item_rows is empty (every user has >= 1 event).")
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = items_list.flatten()
        if flat.null_count:
            position = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
            raise PreparedDataError(f"{where}, row {segment.start + _row_of(offsets, position)}: item_rows holds a null row.")
        items = flat.to_numpy().astype(np.int64, copy=False)
        self.counter.events += len(items)
        num_items = self.metadata.num_items
        if len(items) and (items.min() < 0 or items.max() >= num_items):
            position = int(np.flatnonzero((items < 0) | (items >= num_items))[0])
            raise PreparedDataError(
                f"{where}, row {segment.start + _row_of(offsets, position)}: item row {int(items[position])} is outside "
                f"[0, num_items={num_items}) (negative, or beyond the vocabulary of {METADATA_FILE})."
            )
        if segment.whole and len(items) != segment.group_events:
            raise PreparedDataError(
                f"{where}: holds {len(items)} events but {METADATA_FILE} says {segment.group_events}; the metadata does not "
                "describe this file. Prepare the directory again (or rerun describe)."
            )
        actions = self._actions(table, lengths, offsets, segment, where) if self.metadata.has_actions else None
        timestamps = self._timestamps(table, lengths, offsets, segment, where) if self.with_timestamps else None
        user_ids = _user_ids(users) if self.with_user_ids else np.zeros(0, dtype=np.int64)
        sequences = UserSequences(
            items=items, offsets=offsets, user_ids=user_ids, num_items=num_items,
            num_action_types=self.metadata.num_action_types, actions=actions, timestamps=timestamps,
        )
        return UserChunk(sequences, segment)

    def _actions(self, table: pa.Table, lengths: np.ndarray, offsets: np.ndarray, segment: Segment, where: str) -> np.ndarray:
        actions = _aligned_list(table, ACTIONS_COLUMN, lengths, offsets, segment, where)
        types = self.metadata.num_action_types
        if len(actions) and (actions.min() < 0 or actions.max() >= types):
            position = int(np.flatnonzero((actions < 0) | (actions >= types))[0])
            raise PreparedDataError(
                f"{where}, row {segment.start + _row_of(offsets, position)}: action {int(actions[position])} is outside "
                f"[0, num_action_types={types})."
            )
        return actions

    def _timestamps(self, table: pa.Table, lengths: np.ndarray, offsets: np.ndarray, segment: Segment, where: str) -> np.ndarray:
        timestamps = _aligned_list(table, TIMESTAMPS_COLUMN, lengths, offsets, segment, where)
        # Oldest first (the contract): a later event of the same user may share its time but never be older.
        older = np.flatnonzero(timestamps[1:] < timestamps[:-1]) + 1
        older = older[offsets[np.searchsorted(offsets, older, side="right") - 1] != older]  # not a user's first event
        if len(older):
            position = int(older[0])
            row = _row_of(offsets, position)
            raise PreparedDataError(
                f"{where}, row {segment.start + row}: timestamps decrease at event {position - int(offsets[row])} "
                f"({int(timestamps[position - 1])} then {int(timestamps[position])}); a user's events are stored oldest first."
            )
        return timestamps


def _aligned_list(table: pa.Table, column_name: str, lengths: np.ndarray, offsets: np.ndarray, segment: Segment, where: str) -> np.ndarray:
    """A list column with one entry per event (``actions``, ``timestamps``) as flat int64, checked against ``item_rows``' lengths."""
    column = _one_chunk(table.column(column_name))
    column_lengths = column.value_lengths().fill_null(-1).to_numpy()
    if not np.array_equal(column_lengths, lengths):
        row = int(np.flatnonzero(column_lengths != lengths)[0])
        raise PreparedDataError(
            f"{where}, row {segment.start + row}: {column_name} has {int(column_lengths[row])} values (-1: null) but item_rows "
            f"has {int(lengths[row])}; every list of a row has one entry per event."
        )
    flat = column.flatten()
    if flat.null_count:
        position = int(np.flatnonzero(flat.is_null().to_numpy(zero_copy_only=False))[0])
        raise PreparedDataError(f"{where}, row {segment.start + _row_of(offsets, position)}: {column_name} holds a null.")
    return flat.to_numpy().astype(np.int64, copy=False)


_MAGIC = b"PAR1"
_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") else None


def _release_freed_memory() -> None:
    """Hand the memory of earlier row groups back to the system. Arrow's default pool (mimalloc) and glibc's
    malloc (numpy, torch) both keep freed pages; without this the peak RSS crept up with the row groups read
    (docs/performance.md, data at scale)."""
    pa.default_memory_pool().release_unused()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):  # glibc only (not musl)
        _LIBC.malloc_trim(0)


def _read_footer(handle: io.FileIO) -> bytes:
    """The file's footer and its 8-byte trailer, reading exactly those bytes: pyarrow's own open reads the last
    64 KiB of every file (``kDefaultFooterReadSize`` in Arrow's ``parquet/file_reader.cc``), many times a footer."""
    size = handle.seek(0, os.SEEK_END)
    if size < 2 * len(_MAGIC) + 4:
        raise ValueError(f"{size} bytes: too short for parquet")
    handle.seek(size - 8)
    trailer = handle.read(8)
    length = int.from_bytes(trailer[:4], "little")
    if trailer[4:] != _MAGIC:
        raise ValueError("no parquet magic bytes at the end")
    if length > size - 12:
        raise ValueError(f"the footer claims {length} bytes, more than the file holds")
    handle.seek(size - 8 - length)
    return handle.read(length) + trailer


def _parse_footer(raw: bytes) -> pq.FileMetaData:
    # read_metadata parses a buffer that ends with the footer and its trailer; the leading magic stands in for the data.
    return pq.read_metadata(pa.BufferReader(_MAGIC + raw))


def _check_list(schema: pa.Schema, column: str, name: str, value_types: tuple[pa.DataType, ...] | None) -> None:
    kind = schema.field(column).type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    value = kind.value_type if is_list else None
    ok = is_list and (value in value_types if value_types is not None else pa.types.is_integer(value))
    if not ok:
        wanted = " or ".join(f"list<{t}>" for t in value_types) if value_types is not None else "a list of integers"
        raise PreparedDataError(f"{name}: column {column!r} is {kind}; it must be {wanted}.")


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _row_of(offsets: np.ndarray, position: int) -> int:
    return int(np.searchsorted(offsets, position, side="right") - 1)


def _user_ids(users: pa.Array) -> np.ndarray:
    if pa.types.is_integer(users.type):
        return users.to_numpy().astype(np.int64, copy=False)
    return users.to_numpy(zero_copy_only=False)


def _raise_duplicate(users: pa.Array, segment: Segment, where: str) -> None:
    values = users.to_pylist()
    first: dict[object, int] = {}
    for row, user in enumerate(values):
        if user in first:
            raise PreparedDataError(
                f"{where}, rows {segment.start + first[user]} and {segment.start + row}: user_id {user!r} appears twice; "
                "each user must be in exactly one row (group the events by user)."
            )
        first[user] = row


def _short_list(values: list[int], limit: int = 6) -> str:
    return ", ".join(map(str, values[:limit])) + (", ..." if len(values) > limit else "")

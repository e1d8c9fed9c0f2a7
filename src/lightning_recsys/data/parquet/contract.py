"""The prepared-data contract, version 1: a directory of per-user parquet files any engine can write.

A prepared directory ``DIR`` holds:

- ``DIR/users/part-NNNNN.parquet``: one row per user. Columns ``user_id`` (int64 or string),
  ``item_rows`` (list of int32 or int64: rows of the item table, oldest first), and optionally
  ``actions`` (list of int32/int64) and ``timestamps`` (list of int64), each of the same length as
  ``item_rows``. Every user is in exactly one row of one file.
- ``DIR/items.parquet``: ``item_id`` (the raw id, int64 or string), ``row`` (int64), ``count``
  (int64 events). Rows ``0 .. V-1`` are the in-vocabulary items, most frequent first (ties: raw id
  ascending). The shared out-of-vocabulary row, ``V``, is not listed; its counts are in the metadata.
- ``DIR/metadata.json``: ``PreparedMetadata`` below: the sizes, the per-file and per-row-group
  user and event counts (which let a reader cut exact row ranges per rank without opening a
  parquet footer), and how the data was prepared.

``read_metadata`` loads and validates the metadata; ``write_metadata`` writes it;
``describe`` scans user files another engine wrote and writes their metadata.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

FORMAT = "lightning-recsys/user-sequences"
VERSION = 1

METADATA_FILE = "metadata.json"
ITEMS_FILE = "items.parquet"
USERS_DIR = "users"
PART_FILE_PATTERN = "part-{index:05d}.parquet"

# Columns of the user files.
USER_ID_COLUMN = "user_id"
ITEM_ROWS_COLUMN = "item_rows"
ACTIONS_COLUMN = "actions"
TIMESTAMPS_COLUMN = "timestamps"
# Columns of items.parquet.
ITEM_ID_COLUMN = "item_id"
ROW_COLUMN = "row"
COUNT_COLUMN = "count"

USER_ID_TYPES: tuple[str, ...] = ("int64", "string")
# Row groups count their users with 1, 2 and 3 events: users a leave-one-out split cannot use for
# every view, counted per row group so a reader knows each rank's usable users from metadata alone.
SHORT_USER_LENGTHS = 3
PREPARE_TOOL = "lightning-recsys prepare"
DESCRIBE_TOOL = "lightning-recsys prepare --describe"
TIES_INPUT_ORDER = "input order"
# How our writers write user files (pyarrow ParquetWriter keywords); any layout reads, this one reads least.
# Small data pages let a rank that needs only the head of a row group stop after its rows (a reader
# decodes pages in order, and pyarrow's default 1 MiB page held a whole column chunk); user ids are
# unique and items many, so a dictionary page (read whole, before any row) saves nothing.
USER_FILE_WRITE_OPTIONS: Mapping[str, Any] = {"data_page_size": 32 * 1024, "use_dictionary": False}


class PreparedDataError(ValueError):
    """A prepared directory (or the input of ``prepare``) breaks the contract; the message names the file and field."""


def part_file_name(index: int) -> str:
    """``users/part-00000.parquet``: the relative path of the ``index``-th user file."""
    return f"{USERS_DIR}/{PART_FILE_PATTERN.format(index=index)}"


@dataclasses.dataclass(frozen=True)
class RowGroupInfo:
    """One parquet row group of a user file: its users (rows), events, and users with 1, 2, 3 events."""

    num_rows: int
    num_events: int
    short_users: tuple[int, int, int] = (0, 0, 0)

    def to_dict(self) -> dict[str, Any]:
        return {"num_rows": self.num_rows, "num_events": self.num_events, "short_users": list(self.short_users)}


@dataclasses.dataclass(frozen=True)
class FileInfo:
    """One user file: its path relative to the directory, its users, events and row groups (in order)."""

    path: str
    num_rows: int
    num_events: int
    row_groups: tuple[RowGroupInfo, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "num_rows": self.num_rows,
            "num_events": self.num_events,
            "row_groups": [group.to_dict() for group in self.row_groups],
        }


@dataclasses.dataclass(frozen=True)
class PreparedBy:
    """How the directory was written: the tool and its inputs and settings (informational)."""

    tool: str
    package_version: str
    inputs: tuple[str, ...] = ()
    input_format: str = "unknown"
    min_item_count: int = 1
    time_column: str | None = None
    ties: str = TIES_INPUT_ORDER
    created: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "package_version": self.package_version,
            "inputs": list(self.inputs),
            "input_format": self.input_format,
            "min_item_count": self.min_item_count,
            "time_column": self.time_column,
            "ties": self.ties,
            "created": self.created,
        }


@dataclasses.dataclass(frozen=True)
class RowGroupRef:
    """A row group located in the whole data set: global user order is file order, then row order."""

    file_index: int
    path: str  # relative to the directory
    row_group: int  # index inside its file
    first_user: int  # global index of its first row
    num_rows: int
    num_events: int
    short_users: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class PreparedMetadata:
    """``DIR/metadata.json``, typed. Construct it validated (``__post_init__`` checks every field)."""

    num_items: int
    oov_row: int | None
    oov_items: int
    oov_events: int
    num_users: int
    num_events: int
    users_with_one_event: int
    num_action_types: int
    user_id_type: str
    has_actions: bool
    has_timestamps: bool
    files: tuple[FileInfo, ...]
    prepared_by: PreparedBy
    # Optional addition to version 1: the raw action values whose codes are 0, 1, ... when the raw
    # action column held strings (None: the action codes are the raw integers).
    action_values: tuple[str, ...] | None = None
    format: str = FORMAT
    version: int = VERSION

    def __post_init__(self) -> None:
        _check_consistent(self, METADATA_FILE)

    @property
    def vocabulary_size(self) -> int:
        """In-vocabulary rows ``V`` (the rows listed in items.parquet): ``num_items`` less the OOV row."""
        return self.num_items - (1 if self.oov_row is not None else 0)

    def row_groups(self) -> Iterator[RowGroupRef]:
        """Every row group, in global user order, with the global index of its first user."""
        return (self._row_group_ref(index) for index in range(len(self._row_group_index[0])))

    def row_groups_holding(self, first_user: int, stop_user: int) -> Iterator[RowGroupRef]:
        """The row groups that hold any of the global users ``[first_user, stop_user)``, in order: found by bisection,
        so a rank's plan costs its own row groups, not every row group of the data set."""
        starts = self._row_group_index[0]
        index = max(0, bisect.bisect_right(starts, first_user) - 1)
        while index < len(starts) and starts[index] < stop_user:
            ref = self._row_group_ref(index)
            if ref.num_rows and ref.first_user + ref.num_rows > first_user:
                yield ref
            index += 1

    def _row_group_ref(self, index: int) -> RowGroupRef:
        starts, locations = self._row_group_index
        file_index, group_index = locations[index]
        info = self.files[file_index]
        group = info.row_groups[group_index]
        return RowGroupRef(file_index, info.path, group_index, starts[index], group.num_rows, group.num_events, group.short_users)

    @functools.cached_property
    def _row_group_index(self) -> tuple[list[int], list[tuple[int, int]]]:
        """Each row group's first global user, and its ``(file, row group)``, in global order (computed once)."""
        starts, locations, first = [], [], 0
        for file_index, info in enumerate(self.files):
            for group_index, group in enumerate(info.row_groups):
                starts.append(first)
                locations.append((file_index, group_index))
                first += group.num_rows
        return starts, locations

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": self.format,
            "version": self.version,
            "num_items": self.num_items,
            "oov_row": self.oov_row,
            "oov_items": self.oov_items,
            "oov_events": self.oov_events,
            "num_users": self.num_users,
            "num_events": self.num_events,
            "users_with_one_event": self.users_with_one_event,
            "num_action_types": self.num_action_types,
            "user_id_type": self.user_id_type,
            "has_actions": self.has_actions,
            "has_timestamps": self.has_timestamps,
            "files": [info.to_dict() for info in self.files],
            "prepared_by": self.prepared_by.to_dict(),
        }
        if self.action_values is not None:
            data["action_values"] = list(self.action_values)
        return data

    @classmethod
    def from_dict(cls, data: Any, source: str = METADATA_FILE) -> PreparedMetadata:
        """Parse and validate a decoded metadata.json; errors name ``source`` and the field."""
        top = _Fields(data, source, "")
        fmt = top.string("format")
        if fmt != FORMAT:
            raise PreparedDataError(f"{source}: field 'format' is {fmt!r}; expected {FORMAT!r}.")
        version = top.integer("version", 1)
        if version != VERSION:
            raise PreparedDataError(
                f"{source}: field 'version' is {version}; this release reads version {VERSION}. "
                "Prepare the data again with this release, or upgrade lightning-recsys."
            )
        files = tuple(_file_from_dict(entry, source, f"files[{i}]") for i, entry in enumerate(top.array("files")))
        prepared = _Fields(top.get("prepared_by", dict), source, "prepared_by.")
        prepared_by = PreparedBy(
            tool=prepared.string("tool"),
            package_version=prepared.string("package_version"),
            inputs=tuple(prepared.string_list("inputs")),
            input_format=prepared.string("input_format"),
            min_item_count=prepared.integer("min_item_count", 1),
            time_column=prepared.optional_string("time_column"),
            ties=prepared.string("ties"),
            created=prepared.string("created"),
        )
        action_values = top.optional_string_list("action_values")
        try:
            return cls(
                num_items=top.integer("num_items", 1),
                oov_row=top.optional_integer("oov_row", 0),
                oov_items=top.integer("oov_items", 0),
                oov_events=top.integer("oov_events", 0),
                num_users=top.integer("num_users", 0),
                num_events=top.integer("num_events", 0),
                users_with_one_event=top.integer("users_with_one_event", 0),
                num_action_types=top.integer("num_action_types", 0),
                user_id_type=top.string("user_id_type"),
                has_actions=top.boolean("has_actions"),
                has_timestamps=top.boolean("has_timestamps"),
                files=files,
                prepared_by=prepared_by,
                action_values=None if action_values is None else tuple(action_values),
            )
        except PreparedDataError as error:
            # The consistency checks name the field; say which file they read.
            message = str(error)
            if message.startswith(f"{METADATA_FILE}: "):
                raise PreparedDataError(f"{source}: {message.removeprefix(f'{METADATA_FILE}: ')}") from None
            raise


class _Fields:
    """Typed access to one JSON object's fields; errors name the file and the field's path."""

    def __init__(self, data: Any, source: str, prefix: str) -> None:
        if not isinstance(data, Mapping):
            raise PreparedDataError(f"{source}: {prefix.rstrip('.') or 'the top level'} must be a JSON object, got {type(data).__name__}.")
        self.data, self.source, self.prefix = data, source, prefix

    def _fail(self, key: str, rule: str, value: Any) -> PreparedDataError:
        return PreparedDataError(f"{self.source}: field '{self.prefix}{key}' must be {rule}, got {value!r}.")

    def get(self, key: str, kind: type) -> Any:
        if key not in self.data:
            raise PreparedDataError(f"{self.source}: field '{self.prefix}{key}' is missing.")
        value = self.data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self._fail(key, _JSON_NAMES.get(kind, kind.__name__), value)
        return value

    def integer(self, key: str, minimum: int) -> int:
        value = self.get(key, int)
        if value < minimum:
            raise self._fail(key, f"an integer >= {minimum}", value)
        return value

    def optional_integer(self, key: str, minimum: int) -> int | None:
        if self.data.get(key, None) is None:
            if key not in self.data:
                raise PreparedDataError(f"{self.source}: field '{self.prefix}{key}' is missing (null is allowed).")
            return None
        return self.integer(key, minimum)

    def string(self, key: str) -> str:
        return self.get(key, str)

    def optional_string(self, key: str) -> str | None:
        return None if self.data.get(key, None) is None else self.string(key)

    def boolean(self, key: str) -> bool:
        return self.get(key, bool)

    def array(self, key: str) -> list[Any]:
        return self.get(key, list)

    def string_list(self, key: str) -> list[str]:
        values = self.array(key)
        if not all(isinstance(value, str) for value in values):
            raise self._fail(key, "a list of strings", values)
        return values

    def optional_string_list(self, key: str) -> list[str] | None:
        return None if self.data.get(key, None) is None else self.string_list(key)


_JSON_NAMES = {int: "an integer", str: "a string", bool: "a boolean", list: "a list", dict: "a JSON object"}


def _file_from_dict(data: Any, source: str, prefix: str) -> FileInfo:
    fields = _Fields(data, source, prefix + ".")
    path = fields.string("path")
    if Path(path).is_absolute() or ".." in Path(path).parts:
        raise PreparedDataError(f"{source}: field '{prefix}.path' must be relative to the directory, got {path!r}.")
    groups = []
    for i, entry in enumerate(fields.array("row_groups")):
        group = _Fields(entry, source, f"{prefix}.row_groups[{i}].")
        short = group.array("short_users")
        if len(short) != SHORT_USER_LENGTHS or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in short):
            raise group._fail("short_users", f"{SHORT_USER_LENGTHS} integers >= 0 (users with 1, 2, 3 events)", short)
        groups.append(RowGroupInfo(group.integer("num_rows", 0), group.integer("num_events", 0), (short[0], short[1], short[2])))
    return FileInfo(path, fields.integer("num_rows", 0), fields.integer("num_events", 0), tuple(groups))


def _check_consistent(meta: PreparedMetadata, source: str) -> None:
    """The cross-field rules: sums agree, the OOV row is the last row, the enums are known."""

    def fail(field: str, message: str) -> PreparedDataError:
        return PreparedDataError(f"{source}: field '{field}' {message}")

    if meta.format != FORMAT:
        raise fail("format", f"is {meta.format!r}; expected {FORMAT!r}.")
    if meta.version != VERSION:
        raise fail("version", f"is {meta.version}; expected {VERSION}.")
    if meta.user_id_type not in USER_ID_TYPES:
        raise fail("user_id_type", f"must be one of {USER_ID_TYPES}, got {meta.user_id_type!r}.")
    if meta.num_items < 1:
        raise fail("num_items", f"must be >= 1, got {meta.num_items}.")
    if meta.oov_row is not None and meta.oov_row != meta.num_items - 1:
        raise fail("oov_row", f"must be num_items - 1 = {meta.num_items - 1} (the last row) or null, got {meta.oov_row}.")
    if meta.oov_row is None and (meta.oov_items or meta.oov_events):
        raise fail("oov_row", f"is null but oov_items={meta.oov_items} and oov_events={meta.oov_events} are not 0.")
    if meta.num_action_types < 0 or (meta.num_action_types > 0) != meta.has_actions:
        raise fail("num_action_types", f"is {meta.num_action_types} with has_actions={meta.has_actions}; it must be > 0 exactly when there are actions.")
    if meta.action_values is not None and len(meta.action_values) != meta.num_action_types:
        raise fail("action_values", f"lists {len(meta.action_values)} values but num_action_types is {meta.num_action_types}.")
    if not meta.files:
        raise fail("files", "is empty; a prepared directory has at least one user file.")
    paths = [info.path for info in meta.files]
    if len(set(paths)) != len(paths):
        raise fail("files", f"lists a path twice: {sorted(p for p in set(paths) if paths.count(p) > 1)}.")
    for i, info in enumerate(meta.files):
        rows = sum(group.num_rows for group in info.row_groups)
        events = sum(group.num_events for group in info.row_groups)
        if rows != info.num_rows or events != info.num_events:
            raise fail(
                f"files[{i}]", f"({info.path}) has num_rows={info.num_rows}, num_events={info.num_events} but its row groups sum to {rows}, {events}."
            )
        for j, group in enumerate(info.row_groups):
            if group.num_events < group.num_rows or sum(group.short_users) > group.num_rows:
                raise fail(f"files[{i}].row_groups[{j}]", f"is impossible: {group.to_dict()} (every user has >= 1 event).")
    totals = {
        "num_users": (meta.num_users, sum(info.num_rows for info in meta.files)),
        "num_events": (meta.num_events, sum(info.num_events for info in meta.files)),
        "users_with_one_event": (meta.users_with_one_event, sum(g.short_users[0] for info in meta.files for g in info.row_groups)),
    }
    for field, (stated, summed) in totals.items():
        if stated != summed:
            raise fail(field, f"is {stated} but the files' row groups sum to {summed}.")


def read_metadata(directory: str | os.PathLike[str]) -> PreparedMetadata:
    """Load and validate ``directory/metadata.json``; a ``PreparedDataError`` names the file and field."""
    path = Path(directory) / METADATA_FILE
    if not Path(directory).is_dir():
        raise PreparedDataError(f"{directory}: not a directory; expected a prepared directory (run `lightning-recsys prepare`).")
    if not path.is_file():
        raise PreparedDataError(
            f"{path}: missing. Write it with `lightning-recsys prepare` (raw events) or "
            f"`lightning-recsys prepare --describe {directory}` (user files another engine wrote)."
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PreparedDataError(f"{path}: not valid JSON ({error}).") from None
    return PreparedMetadata.from_dict(data, source=str(path))


def write_metadata(directory: str | os.PathLike[str], metadata: PreparedMetadata) -> Path:
    """Write ``directory/metadata.json`` atomically (a reader never sees half a file); returns its path."""
    path = Path(directory) / METADATA_FILE
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(metadata.to_dict(), indent=1) + "\n", encoding="utf-8")
    os.replace(temporary, path)
    return path


def row_group_bounds(event_counts: Sequence[int], events_per_group: int) -> list[int]:
    """Split rows (with these event counts, in order) into groups of about ``events_per_group`` events.

    Returns the start row of every group and, last, the number of rows. A group closes at the
    first row that brings its cumulative events to ``events_per_group`` or more, so a group holds
    at least one row and at most ``events_per_group`` events plus one user's history.
    """
    if events_per_group < 1:
        raise ValueError(f"events_per_group={events_per_group} must be >= 1.")
    bounds, running = [0], 0
    for row, count in enumerate(event_counts):
        running += count
        if running >= events_per_group:
            bounds.append(row + 1)
            running = 0
    if bounds[-1] != len(event_counts):
        bounds.append(len(event_counts))
    return bounds


__all__ = [
    "ACTIONS_COLUMN",
    "COUNT_COLUMN",
    "DESCRIBE_TOOL",
    "FORMAT",
    "ITEMS_FILE",
    "ITEM_ID_COLUMN",
    "ITEM_ROWS_COLUMN",
    "METADATA_FILE",
    "PART_FILE_PATTERN",
    "PREPARE_TOOL",
    "ROW_COLUMN",
    "SHORT_USER_LENGTHS",
    "TIES_INPUT_ORDER",
    "TIMESTAMPS_COLUMN",
    "USERS_DIR",
    "USER_ID_COLUMN",
    "USER_ID_TYPES",
    "VERSION",
    "FileInfo",
    "PreparedBy",
    "PreparedDataError",
    "PreparedMetadata",
    "RowGroupInfo",
    "RowGroupRef",
    "part_file_name",
    "read_metadata",
    "row_group_bounds",
    "write_metadata",
]


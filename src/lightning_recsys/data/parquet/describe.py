"""``describe``: write metadata.json for user files another engine (Spark, DuckDB, ...) wrote to the contract.

    lightning-recsys prepare --describe DIR

``DIR`` holds ``items.parquet`` and ``users/**/*.parquet`` (sorted by path: that is the global
user order). One streaming pass reads a row group at a time, checks it against the contract
(types, nulls, list lengths, rows inside the vocabulary), and counts its users, events and short
users; memory holds one row group. A user in two rows is found with DuckDB (out of core) when it
is installed. Errors name the file, the row group and the row.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lightning_recsys.data.parquet.contract import (
    ACTIONS_COLUMN,
    COUNT_COLUMN,
    DESCRIBE_TOOL,
    ITEM_ID_COLUMN,
    ITEM_ROWS_COLUMN,
    ITEMS_FILE,
    ROW_COLUMN,
    TIES_INPUT_ORDER,
    TIMESTAMPS_COLUMN,
    USER_ID_COLUMN,
    USERS_DIR,
    FileInfo,
    PreparedBy,
    PreparedDataError,
    PreparedMetadata,
    RowGroupInfo,
    write_metadata,
)

log = logging.getLogger(__name__)


def _user_files(directory: Path) -> list[Path]:
    users = directory / USERS_DIR
    if not users.is_dir():
        raise PreparedDataError(f"{users}: missing; the user files go in {USERS_DIR}/ (one row per user).")
    files = sorted(p for p in users.rglob("*.parquet") if p.is_file() and not any(part.startswith((".", "_")) for part in p.relative_to(users).parts))
    if not files:
        raise PreparedDataError(f"{users}: holds no .parquet files.")
    return files


def _vocabulary_size(path: Path) -> int:
    """Rows listed in items.parquet; they must be exactly 0 .. V-1."""
    if not path.is_file():
        raise PreparedDataError(f"{path}: missing; it maps raw item ids ({ITEM_ID_COLUMN}) to rows ({ROW_COLUMN}) with counts ({COUNT_COLUMN}).")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise PreparedDataError(f"{path}: not a readable parquet file ({error}).") from None
    for column in (ITEM_ID_COLUMN, ROW_COLUMN, COUNT_COLUMN):
        if column not in schema.names:
            raise PreparedDataError(f"{path}: column {column!r} is missing; it has {schema.names}.")
    rows = pq.read_table(path, columns=[ROW_COLUMN]).column(ROW_COLUMN)
    if rows.null_count:
        raise PreparedDataError(f"{path}: column {ROW_COLUMN!r} has {rows.null_count} null(s).")
    values = np.sort(rows.to_numpy())
    if len(values) == 0 or not np.array_equal(values, np.arange(len(values))):
        raise PreparedDataError(f"{path}: column {ROW_COLUMN!r} must hold each of 0 .. {len(values) - 1} once (the in-vocabulary rows).")
    return len(values)


def _check_schema(path: Path, schema: pa.Schema) -> tuple[str, bool, bool]:
    def list_of_ints(name: str, allowed: tuple[pa.DataType, ...]) -> None:
        kind = schema.field(name).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or kind.value_type not in allowed:
            raise PreparedDataError(f"{path}: column {name!r} is {kind}; the contract wants a list of {' or '.join(map(str, allowed))}.")

    for name in (USER_ID_COLUMN, ITEM_ROWS_COLUMN):
        if name not in schema.names:
            raise PreparedDataError(f"{path}: column {name!r} is missing; it has {schema.names}.")
    user_type = schema.field(USER_ID_COLUMN).type
    if pa.types.is_integer(user_type):
        id_type = "int64"
    elif pa.types.is_string(user_type) or pa.types.is_large_string(user_type):
        id_type = "string"
    else:
        raise PreparedDataError(f"{path}: column {USER_ID_COLUMN!r} is {user_type}; the contract wants int64 or string.")
    list_of_ints(ITEM_ROWS_COLUMN, (pa.int32(), pa.int64()))
    if ACTIONS_COLUMN in schema.names:
        list_of_ints(ACTIONS_COLUMN, (pa.int32(), pa.int64()))
    if TIMESTAMPS_COLUMN in schema.names:
        list_of_ints(TIMESTAMPS_COLUMN, (pa.int64(),))
    return id_type, ACTIONS_COLUMN in schema.names, TIMESTAMPS_COLUMN in schema.names


def _first_row(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _scan_group(where: str, table: pa.Table, vocabulary: int) -> tuple[np.ndarray, int, int]:
    """Check one row group; returns its lengths, its events in the OOV row and its largest action (-1: none)."""
    if table.column(USER_ID_COLUMN).null_count:
        row = _first_row(table.column(USER_ID_COLUMN).is_null().to_numpy(zero_copy_only=False))
        raise PreparedDataError(f"{where}, row {row}: {USER_ID_COLUMN} is null.")
    items = table.column(ITEM_ROWS_COLUMN).combine_chunks()
    if items.null_count:
        raise PreparedDataError(f"{where}, row {_first_row(items.is_null().to_numpy(zero_copy_only=False))}: {ITEM_ROWS_COLUMN} is null.")
    lengths = pc.list_value_length(items).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(lengths) and lengths.min() == 0:
        raise PreparedDataError(f"{where}, row {_first_row(lengths == 0)}: {ITEM_ROWS_COLUMN} is empty; every user has >= 1 event.")
    values = pc.list_flatten(items)
    if values.null_count:
        raise PreparedDataError(f"{where}: {ITEM_ROWS_COLUMN} holds {values.null_count} null row(s).")
    rows = values.to_numpy(zero_copy_only=False)
    oov_events = 0
    if len(rows):
        bad = (rows < 0) | (rows > vocabulary)
        if bad.any():
            event = _first_row(bad)
            row = int(np.searchsorted(np.cumsum(lengths), event, side="right"))
            raise PreparedDataError(
                f"{where}, row {row}: {ITEM_ROWS_COLUMN} holds {int(rows[event])}, outside 0 .. {vocabulary} "
                f"(items.parquet lists {vocabulary} rows; row {vocabulary} is the shared OOV row)."
            )
        oov_events = int(np.count_nonzero(rows == vocabulary))
    max_action = -1
    for name in (ACTIONS_COLUMN, TIMESTAMPS_COLUMN):
        if name not in table.column_names:
            continue
        column = table.column(name).combine_chunks()
        other = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        if column.null_count or not np.array_equal(other, lengths):
            mismatch = _first_row(np.asarray(other != lengths) | column.is_null().to_numpy(zero_copy_only=False))
            raise PreparedDataError(f"{where}, row {mismatch}: {name} must be a list as long as {ITEM_ROWS_COLUMN} ({lengths[mismatch]}).")
        if name == ACTIONS_COLUMN and len(rows):
            actions = pc.list_flatten(column)
            low, high = pc.min(actions).as_py(), pc.max(actions).as_py()
            if actions.null_count or low is None or low < 0:
                raise PreparedDataError(f"{where}: {ACTIONS_COLUMN} must be integers >= 0 without nulls (min {low}).")
            max_action = int(high)
    return lengths, oov_events, max_action


def _check_unique_users(files: list[Path], memory_limit: str) -> None:
    try:
        import duckdb  # noqa: PLC0415
    except ImportError:
        log.warning("describe: DuckDB is not installed; not checking that every user is in one row.")
        return
    con = duckdb.connect()
    try:
        con.execute(f"SET memory_limit = '{memory_limit}'")
        listed = "[" + ", ".join("'" + str(f).replace("'", "''") + "'" for f in files) + "]"
        duplicates = con.execute(
            f"SELECT {USER_ID_COLUMN}, list(DISTINCT filename) FROM read_parquet({listed}, filename = true) "
            f"GROUP BY {USER_ID_COLUMN} HAVING count(*) > 1 LIMIT 3"
        ).fetchall()
    finally:
        con.close()
    if duplicates:
        shown = "; ".join(f"user {user!r} in {names}" for user, names in duplicates)
        raise PreparedDataError(f"a user is in more than one row (each user must be in exactly one row of one file): {shown}.")


def describe_directory(
    directory: str | os.PathLike[str],
    oov_items: int = 0,
    check_unique_users: bool = True,
    memory_limit: str = "2GB",
    report: Callable[[str], None] | None = None,
) -> PreparedMetadata:
    """Scan ``directory`` (see the module docstring), write its metadata.json and return it.

    Args:
        oov_items: how many raw items the writer sent to the OOV row (the user files cannot tell).
        check_unique_users: also check (with DuckDB, out of core) that no user is in two rows.
        memory_limit: DuckDB's limit for that check.
    """
    if oov_items < 0:
        raise PreparedDataError(f"oov_items={oov_items} must be >= 0.")
    say = report if report is not None else log.info
    root = Path(directory)
    vocabulary = _vocabulary_size(root / ITEMS_FILE)
    files = _user_files(root)
    infos: list[FileInfo] = []
    kinds: set[tuple[str, bool, bool]] = set()
    oov_events, max_action = 0, -1
    for path in files:
        try:
            parquet = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as error:
            raise PreparedDataError(f"{path}: not a readable parquet file ({error}).") from None
        kind = _check_schema(path, parquet.schema_arrow)
        kinds.add(kind)
        if len(kinds) > 1:
            raise PreparedDataError(f"{path}: its columns (user id {kind[0]}, actions {kind[1]}, timestamps {kind[2]}) differ from the files before it.")
        columns = [USER_ID_COLUMN, ITEM_ROWS_COLUMN] + [c for c, has in ((ACTIONS_COLUMN, kind[1]), (TIMESTAMPS_COLUMN, kind[2])) if has]
        groups = []
        for index in range(parquet.metadata.num_row_groups):
            where = f"{path}, row group {index}"
            try:
                table = parquet.read_row_group(index, columns=columns)
            except (pa.ArrowInvalid, OSError) as error:
                raise PreparedDataError(f"{where}: unreadable ({error}).") from None
            lengths, oov, actions = _scan_group(where, table, vocabulary)
            oov_events += oov
            max_action = max(max_action, actions)
            short = tuple(int(np.count_nonzero(lengths == n)) for n in (1, 2, 3))
            groups.append(RowGroupInfo(table.num_rows, int(lengths.sum()), (short[0], short[1], short[2])))
        relative = path.relative_to(root).as_posix()
        infos.append(FileInfo(relative, sum(g.num_rows for g in groups), sum(g.num_events for g in groups), tuple(groups)))
        say(f"describe: {relative}: {infos[-1].num_rows} users, {infos[-1].num_events} events, {len(groups)} row group(s)")
    if check_unique_users:
        _check_unique_users(files, memory_limit)
    if oov_items and not oov_events:
        raise PreparedDataError(f"oov_items={oov_items} but no event uses the OOV row {vocabulary}.")
    id_type, has_actions, has_timestamps = kinds.pop()
    has_oov = oov_events > 0
    metadata = PreparedMetadata(
        num_items=vocabulary + (1 if has_oov else 0),
        oov_row=vocabulary if has_oov else None,
        oov_items=oov_items,
        oov_events=oov_events,
        num_users=sum(f.num_rows for f in infos),
        num_events=sum(f.num_events for f in infos),
        users_with_one_event=sum(g.short_users[0] for f in infos for g in f.row_groups),
        num_action_types=max_action + 1 if has_actions else 0,
        user_id_type=id_type,
        has_actions=has_actions,
        has_timestamps=has_timestamps,
        files=tuple(infos),
        prepared_by=PreparedBy(
            tool=DESCRIBE_TOOL,
            package_version=_package_version(),
            inputs=tuple(f.relative_to(root).as_posix() for f in files),
            input_format="user-parquet",
            min_item_count=1,
            time_column=None,
            ties=TIES_INPUT_ORDER,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        ),
    )
    write_metadata(root, metadata)
    return metadata


def _package_version() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("lightning-recsys")
    except Exception:  # noqa: BLE001 (an uninstalled checkout)
        return "unknown"

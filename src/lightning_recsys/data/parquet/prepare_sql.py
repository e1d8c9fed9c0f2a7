"""The DuckDB half of ``prepare``: read the raw events, count the items, and sort the events by user and time.

Everything here runs inside DuckDB, which keeps to ``memory_limit`` and spills to
``temp_directory``: the events are read into a staging view or table with an input ordinal
(``ord``, ``pos``), the item vocabulary is one ``GROUP BY``, and the output is one ``ORDER BY
user, time, ord, pos`` streamed to Python in Arrow batches (``prepare_write`` groups them into
users). Time ties therefore keep the input order: file order (as listed, globs sorted), then row
order inside a file, then item order inside a ``user item1 item2 ...`` line.
"""

from __future__ import annotations

import dataclasses
import errno
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_recsys.data.parquet.contract import PreparedDataError

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

INPUT_FORMATS: tuple[str, ...] = ("auto", "parquet", "csv", "user-item-lines", "user-items-lines")
TEXT_FORMATS: tuple[str, ...] = ("user-item-lines", "user-items-lines")
ID_TYPES: tuple[str, ...] = ("auto", "int", "string")
_INTEGER_TYPES = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT", "HUGEINT", "UHUGEINT"}
# A `user item1 item2 ...` line of a long history is one "line" to DuckDB's reader; 8 MiB holds about
# 10^6 items. DuckDB sizes its read buffers from this (16x for compressed files), so not more.
_MAX_LINE_BYTES = 1 << 23


class PrepareError(PreparedDataError):
    """``prepare`` cannot turn these inputs into the contract; the message names the file, line or setting."""


@dataclasses.dataclass(frozen=True)
class Source:
    """The events view ``events(user, item, ts, action, ord, pos)`` and what ``prepare`` learned while making it."""

    user_type: str  # "int64" or "string"
    item_type: str
    time_type: str | None  # the DuckDB type of the time column, None without one
    action_type: str | None  # "int" or "string", None without actions
    skipped_lines: int  # malformed lines skipped under on_bad_line="skip"
    blank_lines: int  # blank lines of a text layout (no data; skipped and counted)


def quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def quote_identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def connect(database: Path, temp_directory: Path, memory_limit: str, threads: int | None, max_temp_size: str | None) -> duckdb.DuckDBPyConnection:
    """A DuckDB session whose tables live in ``database`` (on disk, so staging never has to fit in memory)."""
    import duckdb  # noqa: PLC0415 (the optional extra)

    con = duckdb.connect(str(database))
    con.execute(f"SET memory_limit = {quote_literal(memory_limit)}")
    con.execute(f"SET temp_directory = {quote_literal(str(temp_directory))}")
    if threads is not None:
        con.execute(f"SET threads = {int(threads)}")
    # Ties keep the input order only if scans and inserts keep it.
    con.execute("SET preserve_insertion_order = true")
    # DuckDB's own progress bar on a terminal; logs get the phase lines instead.
    con.execute(f"SET enable_progress_bar = {str(sys.stderr.isatty()).lower()}")
    if max_temp_size is not None:
        con.execute(f"SET max_temp_directory_size = {quote_literal(max_temp_size)}")
    return con


def translate_error(error: Exception, temp_directory: Path, memory_limit: str) -> Exception:
    """Turn DuckDB's out-of-disk and IO errors into ones that name the directory and the flag to change."""
    import duckdb  # noqa: PLC0415

    message = str(error)
    lowered = message.lower()
    if isinstance(error, duckdb.OutOfMemoryException) and "max_temp_directory_size" in lowered:
        return PrepareError(
            f"DuckDB ran out of temporary disk space in {temp_directory} (its limit, --max-temp-size, was reached) "
            f"while spilling past --memory-limit {memory_limit}. Point --temp-directory at a disk with more free space, "
            f"raise --max-temp-size, or raise --memory-limit. DuckDB said: {message.splitlines()[0]}"
        )
    if "no space left" in lowered or "disk full" in lowered or ("could not write" in lowered and "temp" in lowered):
        return PrepareError(
            f"the disk of the temporary directory {temp_directory} is full. Point --temp-directory at a disk with "
            f"more free space (or raise --memory-limit {memory_limit}). DuckDB said: {message.splitlines()[0]}"
        )
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return PrepareError(f"the disk is full while writing {error.filename or 'the output'}: {error.strerror}. Free space or choose another --output.")
    if isinstance(error, duckdb.ConversionException):
        return PrepareError(f"a value does not convert to its column's type (check --id-type and the columns' types). DuckDB said: {message}")
    if isinstance(error, duckdb.OutOfMemoryException):
        return PrepareError(f"DuckDB ran out of memory under --memory-limit {memory_limit}; raise it or lower --threads. DuckDB said: {message}")
    if isinstance(error, duckdb.InvalidInputException) and ("CSV Error" in message or "Error when sniffing" in message or "Conversion Error" in message):
        return PrepareError(f"malformed input (rerun with --on-bad-line skip to skip and count such lines). DuckDB said: {message}")
    return error


def _normalize_id(expression: str, duck_type: str, id_type: str) -> tuple[str, str]:
    """``(sql, "int64"|"string")``: integer ids become BIGINT, anything else VARCHAR (``--id-type`` forces one)."""
    base = duck_type.upper().split("(")[0]
    if id_type == "string" or (id_type == "auto" and base not in _INTEGER_TYPES):
        return f"CAST({expression} AS VARCHAR)", "string"
    return f"CAST({expression} AS BIGINT)", "int64"  # --id-type int on text: DuckDB's cast error names the value


def _columns(con: duckdb.DuckDBPyConnection, relation_sql: str) -> dict[str, str]:
    return {row[0]: row[1] for row in con.execute(f"DESCRIBE SELECT * FROM {relation_sql}").fetchall()}


def _check_columns(found: dict[str, str], wanted: dict[str, str | None], files: Sequence[str]) -> None:
    for flag, name in wanted.items():
        if name is not None and name not in found:
            shown = files[0] if len(files) == 1 else f"{files[0]} (and {len(files) - 1} more)"
            raise PrepareError(f"{flag} {name!r}: no such column in {shown}; its columns are {sorted(found)}.")


@dataclasses.dataclass(frozen=True)
class Columns:
    user: str
    item: str
    time: str | None
    action: str | None


def time_output(duck_type: str | None) -> str:
    """SQL for the stored ``timestamps`` value of ``ts`` (an int64)."""
    if duck_type is None:
        return "NULL"
    base = duck_type.upper()
    if base.startswith("TIMESTAMP") or base == "DATE":
        return "CAST(epoch(ts) AS BIGINT)"
    return "CAST(floor(ts) AS BIGINT)" if base in {"FLOAT", "DOUBLE"} or base.startswith("DECIMAL") else "CAST(ts AS BIGINT)"


def _types_option(types: dict[str, str]) -> str:
    if not types:
        return ""
    return ", types = {" + ", ".join(f"{quote_literal(k)}: {quote_literal(v)}" for k, v in types.items()) + "}"


def _text_time_type(con: duckdb.DuckDBPyConnection, relation: str, column: str) -> str:
    as_int, as_time, values = con.execute(
        f"SELECT count(TRY_CAST({quote_identifier(column)} AS BIGINT)), count(TRY_CAST({quote_identifier(column)} AS TIMESTAMP)), "
        f"count({quote_identifier(column)}) FROM {relation}"
    ).fetchall()[0]
    if max(as_int, as_time) == 0:
        rows = con.execute(f"SELECT {quote_identifier(column)} FROM {relation} WHERE {quote_identifier(column)} IS NOT NULL LIMIT 1").fetchall()
        raise PrepareError(f"--time-column {column!r} holds neither integers nor times (e.g. {rows[0][0] if rows else None!r}).")
    return "BIGINT" if as_int >= as_time else "TIMESTAMP"


def _rejected_lines(con: duckdb.DuckDBPyConnection, on_bad_line: str) -> int:
    """Malformed CSV lines of the staging read: raise naming them (``error``) or return their count (``skip``)."""
    count = con.execute("SELECT count(DISTINCT (scan_id, file_id, line)) FROM prepare_rejects").fetchall()[0][0]
    if count and on_bad_line == "error":
        examples = con.execute(
            "SELECT s.file_path, r.line, r.error_message, r.csv_line FROM prepare_rejects r "
            "JOIN prepare_reject_scans s ON r.scan_id = s.scan_id AND r.file_id = s.file_id ORDER BY r.file_id, r.line LIMIT 3"
        ).fetchall()
        shown = "; ".join(f"{path}, line {line}: {message} ({text!r})" for path, line, message, text in examples)
        raise PrepareError(f"{count} malformed CSV line(s): {shown}. Use --on-bad-line skip to skip and count them.")
    return int(count)


def stage_table_source(
    con: duckdb.DuckDBPyConnection, files: Sequence[str], input_format: str, columns: Columns, id_type: str,
    on_bad_line: str, csv_delimiter: str, csv_header: bool,
) -> Source:
    """Parquet or CSV events: ``events`` over ``read_parquet`` (ordinal from file index and row number) or a staged CSV table."""
    file_list = "[" + ", ".join(quote_literal(f) for f in files) + "]"
    skipped = 0
    if input_format == "parquet":
        reader = f"read_parquet({file_list}, filename = true, file_row_number = true, union_by_name = true)"
        found = _columns(con, f"read_parquet({file_list}, union_by_name = true)")
        # A file's index in the list, times a stride above any file's row count, plus its row number.
        ordinal = f"(list_position({file_list}, filename)::BIGINT << 40) + file_row_number"
    else:
        # Malformed lines are always collected in a rejects table (DuckDB records each one's file and
        # line); on_bad_line decides whether they fail the run or are skipped and counted.
        options = (
            f"header = {str(csv_header).lower()}, delim = {quote_literal(csv_delimiter)}, ignore_errors = true"
        )
        types = {name: "VARCHAR" for name in (columns.user, columns.item)} if id_type == "string" else {}
        found = _columns(con, f"read_csv({file_list}, {options}{_types_option(types)})")
        _check_columns(found, {"--user-column": columns.user, "--item-column": columns.item, "--time-column": columns.time, "--action-column": columns.action}, files)
        if columns.time is not None and found[columns.time] == "VARCHAR":
            # The sniffer saw a value that is not a time: type the column as most values are, so the
            # odd lines become rejected lines (with their file and line) instead of a text column.
            time_type = _text_time_type(con, f"read_csv({file_list}, {options}{_types_option(types)})", columns.time)
            types[columns.time] = time_type
            found[columns.time] = time_type
        wanted = [c for c in (columns.user, columns.item, columns.time, columns.action) if c is not None]
        # CSV has no row number: stage the rows in input order and use the table's rowid.
        con.execute(
            f"CREATE OR REPLACE TABLE raw_events AS SELECT {', '.join(quote_identifier(c) for c in dict.fromkeys(wanted))} "
            f"FROM read_csv({file_list}, {options}{_types_option(types)}, store_rejects = true, "
            "rejects_table = 'prepare_rejects', rejects_scan = 'prepare_reject_scans')"
        )
        skipped = _rejected_lines(con, on_bad_line)
        reader, ordinal = "raw_events", "rowid"
    _check_columns(found, {"--user-column": columns.user, "--item-column": columns.item, "--time-column": columns.time, "--action-column": columns.action}, files)
    user_sql, user_type = _normalize_id(quote_identifier(columns.user), found[columns.user], id_type)
    item_sql, item_type = _normalize_id(quote_identifier(columns.item), found[columns.item], id_type)
    time_sql, time_type = ("NULL", None) if columns.time is None else (quote_identifier(columns.time), found[columns.time])
    action_sql, action_type = "NULL", None
    if columns.action is not None:
        action_base = found[columns.action].upper().split("(")[0]
        action_type = "int" if action_base in _INTEGER_TYPES else "string"
        action_sql = quote_identifier(columns.action) if action_type == "int" else f"CAST({quote_identifier(columns.action)} AS VARCHAR)"
    con.execute(
        f"CREATE OR REPLACE VIEW events AS SELECT {user_sql} AS user, {item_sql} AS item, {time_sql} AS ts, "
        f"{action_sql} AS action, {ordinal} AS ord, 0 AS pos FROM {reader}"
    )
    return Source(user_type, item_type, time_type, action_type, skipped, 0)


def stage_text_source(con: duckdb.DuckDBPyConnection, files: Sequence[str], input_format: str, id_type: str, on_bad_line: str) -> Source:
    """The academic layouts, read a line at a time in file order; the line's place is its time."""
    con.execute("CREATE OR REPLACE TABLE lines (file_index INTEGER, first_rowid BIGINT, parts VARCHAR[])")
    for index, path in enumerate(files):
        start = con.execute("SELECT count(*) FROM lines").fetchall()[0][0]
        # One VARCHAR column per line (a separator no text line holds), blank lines kept as NULL so
        # that rowid - first_rowid + 1 is the line number.
        con.execute(
            f"INSERT INTO lines SELECT {index}, {start}, regexp_split_to_array(trim(line), '\\s+') "
            f"FROM read_csv({quote_literal(path)}, columns = {{'line': 'VARCHAR'}}, delim = '\\x1f', quote = '', escape = '', "
            f"header = false, auto_detect = false, max_line_size = {_MAX_LINE_BYTES})"
        )
    blank = "parts IS NULL OR parts = ['']"
    bad = f"NOT ({blank}) AND " + ("len(parts) <> 2" if input_format == "user-item-lines" else "len(parts) < 2")
    rule = "'user item' (2 fields)" if input_format == "user-item-lines" else "'user item1 item2 ...' (2 or more fields)"
    blank_lines, bad_lines = con.execute(f"SELECT count(*) FILTER ({blank}), count(*) FILTER ({bad}) FROM lines").fetchall()[0]
    if bad_lines and on_bad_line == "error":
        examples = con.execute(f"SELECT file_index, rowid - first_rowid + 1, array_to_string(parts, ' ') FROM lines WHERE {bad} ORDER BY rowid LIMIT 3").fetchall()
        shown = "; ".join(f"{files[f]}, line {n}: {text!r}" for f, n, text in examples)
        raise PrepareError(f"{bad_lines} malformed line(s), each must be {rule}: {shown}. Use --on-bad-line skip to skip and count them.")
    keep = f"NOT ({blank}) AND NOT ({bad})"
    id_sql = {}
    id_types = {}
    for name, expression in (("user", "parts[1]"), ("item", "item")):
        if id_type == "string":
            is_int = False
        elif id_type == "int":
            is_int = True
        else:
            source = "parts[1]" if name == "user" else ("parts[2]" if input_format == "user-item-lines" else "unnest(parts[2:])")
            query = f"SELECT bool_and(TRY_CAST(x AS BIGINT) IS NOT NULL) FROM (SELECT {source} AS x FROM lines WHERE {keep})"
            is_int = bool(con.execute(query).fetchall()[0][0])
        id_sql[name] = f"CAST({expression} AS BIGINT)" if is_int else expression
        id_types[name] = "int64" if is_int else "string"
    if input_format == "user-item-lines":
        body = f"SELECT parts[1] AS u, parts[2] AS item, rowid AS ord, 0 AS pos FROM lines WHERE {keep}"
    else:
        body = f"SELECT parts[1] AS u, unnest(parts[2:]) AS item, rowid AS ord, generate_subscripts(parts[2:], 1) AS pos FROM lines WHERE {keep}"
    user_expr = id_sql["user"].replace("parts[1]", "u")
    con.execute(
        f"CREATE OR REPLACE VIEW events AS SELECT {user_expr} AS user, {id_sql['item']} AS item, NULL::BIGINT AS ts, "
        f"NULL::INTEGER AS action, ord, pos FROM ({body})"
    )
    return Source(id_types["user"], id_types["item"], None, None, int(bad_lines), int(blank_lines))


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    size: int  # in-vocabulary rows V
    oov_items: int
    oov_events: int
    num_events: int
    num_action_types: int
    action_values: tuple[str, ...] | None


def build_vocabulary(con: duckdb.DuckDBPyConnection, min_item_count: int, source: Source, items_path: Path) -> Vocabulary:
    """Count the items, number the frequent ones by count (ties: raw id), write items.parquet; check nulls."""
    # One pass over the events: the item counts, with the null checks folded into the same GROUP BY.
    null_time = "ts IS NULL" if source.time_type else "false"
    con.execute(
        "CREATE OR REPLACE TABLE item_counts AS SELECT item, count(*) AS n, count(*) FILTER (user IS NULL) AS null_users, "
        f"count(*) FILTER ({null_time}) AS null_times FROM events GROUP BY item"
    )
    totals = con.execute(
        "SELECT coalesce(sum(n), 0), coalesce(sum(null_users), 0), coalesce(sum(n) FILTER (item IS NULL), 0), "
        "coalesce(sum(null_times), 0) FROM item_counts"
    ).fetchall()[0]
    num_events, null_users, null_items, null_times = (int(n) for n in totals)
    if num_events == 0:
        raise PrepareError("the inputs hold no events.")
    for what, count in (("user", null_users), ("item", null_items), ("time", null_times)):
        if count:
            raise PrepareError(f"{count} of {num_events} events have a null {what}; filter them out first (nothing is dropped silently).")
    con.execute(
        "CREATE OR REPLACE TABLE vocab AS SELECT item, (row_number() OVER (ORDER BY n DESC, item ASC) - 1)::BIGINT AS row, n "
        f"FROM item_counts WHERE n >= {int(min_item_count)}"
    )
    size, = con.execute("SELECT count(*) FROM vocab").fetchall()[0]
    oov_items, oov_events = con.execute(f"SELECT count(*), coalesce(sum(n), 0) FROM item_counts WHERE n < {int(min_item_count)}").fetchall()[0]
    con.execute(
        f"COPY (SELECT item AS item_id, row, n::BIGINT AS count FROM vocab ORDER BY row) TO {quote_literal(str(items_path))} (FORMAT parquet)"
    )
    num_action_types, action_values = 0, None
    if source.action_type == "int":
        low, high, null_actions = con.execute("SELECT min(action), max(action), count(*) FILTER (action IS NULL) FROM events").fetchall()[0]
        if null_actions or low < 0:
            raise PrepareError(f"--action-column: actions must be integers >= 0 without nulls; found min {low} and {null_actions} null(s).")
        num_action_types = int(high) + 1
    elif source.action_type == "string":
        values = [row[0] for row in con.execute("SELECT DISTINCT action FROM events ORDER BY action NULLS FIRST").fetchall()]
        if values and values[0] is None:
            raise PrepareError("--action-column: some events have a null action; filter them out first.")
        con.execute("CREATE OR REPLACE TABLE action_codes AS SELECT action, (row_number() OVER (ORDER BY action) - 1)::INTEGER AS code FROM (SELECT DISTINCT action FROM events)")
        num_action_types, action_values = len(values), tuple(values)
    return Vocabulary(int(size), int(oov_items), int(oov_events), num_events, num_action_types, action_values)


def sorted_events(con: duckdb.DuckDBPyConnection, source: Source, vocabulary: Vocabulary, batch_rows: int) -> pa.RecordBatchReader:
    """Every event as ``(user, row, [action], [ts])``, by user, then time, then input order."""
    oov = vocabulary.size  # items outside the vocabulary share the row after it
    select = [f"e.user AS user, coalesce(v.row, {oov})::INTEGER AS row"]
    joins = "events e LEFT JOIN vocab v ON e.item = v.item"
    if source.action_type == "int":
        select.append("e.action::INTEGER AS action")
    elif source.action_type == "string":
        select.append("a.code AS action")
        joins += " LEFT JOIN action_codes a ON e.action = a.action"
    if source.time_type is not None:
        select.append(time_output(source.time_type).replace("ts", "e.ts") + " AS ts")
    order = "e.user, " + ("e.ts, " if source.time_type is not None else "") + "e.ord, e.pos"
    return con.sql(f"SELECT {', '.join(select)} FROM {joins} ORDER BY {order}").to_arrow_reader(batch_rows)


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files of each input in the order given: a file, a directory (its files, sorted), or a glob (sorted)."""
    import glob  # noqa: PLC0415

    files: list[str] = []
    for pattern in inputs:
        path = Path(pattern)
        if path.is_dir():
            found = sorted(str(p) for p in path.rglob("*") if p.is_file() and not p.name.startswith((".", "_")))
        elif path.is_file():
            found = [str(path)]
        else:
            found = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        if not found:
            raise PrepareError(f"--input {pattern!r}: no such file, directory or matching glob.")
        files.extend(str(Path(f).resolve()) for f in found)
    duplicates = sorted({f for f in files if files.count(f) > 1}) if len(files) < 10_000 else []
    if duplicates:
        raise PrepareError(f"--input names a file twice (its events would count twice): {duplicates[:3]}.")
    return files


def detect_format(files: Sequence[str]) -> str:
    """``parquet`` or ``csv`` from the file names; text layouts must be named with ``--input-format``."""
    kinds = set()
    for name in files:
        lowered = re.sub(r"\.(gz|zst|zstd)$", "", name.lower())
        if lowered.endswith((".parquet", ".pq")):
            kinds.add("parquet")
        elif lowered.endswith((".csv", ".tsv")):
            kinds.add("csv")
        else:
            raise PrepareError(
                f"--input-format auto cannot tell the format of {name}: name it with --input-format "
                f"(parquet, csv, user-item-lines or user-items-lines)."
            )
    if len(kinds) > 1:
        raise PrepareError(f"--input mixes {sorted(kinds)} files; prepare one format at a time.")
    return kinds.pop()

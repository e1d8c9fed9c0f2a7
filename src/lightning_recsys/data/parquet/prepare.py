"""``prepare``: raw events (parquet, CSV or the academic text layouts) in, a prepared directory (contract v1) out.

    from lightning_recsys.data.parquet.prepare import PrepareConfig, prepare
    metadata = prepare(PrepareConfig(inputs=("events/*.parquet",), output="prepared", time_column="ts"))

The phases, each logged with its time: read the inputs into DuckDB (``prepare_sql``), count the
items and write ``items.parquet``, sort the events by user, time and input order (out of core,
under ``memory_limit``, spilling to ``temp_directory``), then group them into users and write
``users/part-NNNNN.parquet`` (``prepare_write``), and last ``metadata.json``: a directory with
metadata is complete.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from lightning_recsys.data.parquet.contract import (
    ITEMS_FILE,
    METADATA_FILE,
    PREPARE_TOOL,
    TIES_INPUT_ORDER,
    USERS_DIR,
    PreparedBy,
    PreparedMetadata,
    write_metadata,
)
from lightning_recsys.data.parquet.prepare_sql import (
    ID_TYPES,
    INPUT_FORMATS,
    TEXT_FORMATS,
    Columns,
    PrepareError,
    connect,
    detect_format,
    expand_inputs,
    stage_table_source,
    stage_text_source,
    translate_error,
)

log = logging.getLogger(__name__)

_SIZE = re.compile(r"^\s*\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", re.IGNORECASE)
ON_BAD_LINE = ("error", "skip")
_MAX_ROW_GROUP_EVENTS = 1 << 30  # list offsets of a row group are int32


def require_duckdb() -> None:
    """Raise a clear error when the optional engine is missing."""
    try:
        import duckdb  # noqa: F401, PLC0415
    except ImportError:
        raise ImportError(
            "`lightning-recsys prepare` needs DuckDB, an optional extra: pip install 'lightning-recsys[prepare]'"
        ) from None


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """What ``prepare`` reads and how. Every field is checked at construction; errors name the field, value and rule.

    Args:
        inputs: files, directories (all their files, sorted) or globs (sorted matches), in this order.
        output: the prepared directory (created; must be empty unless ``overwrite``).
        input_format: ``auto`` (from the file names: parquet or csv), ``parquet``, ``csv``,
            ``user-item-lines`` (``user item`` per line) or ``user-items-lines`` (``user item1 item2 ...``).
        user_column, item_column: the id columns (parquet, csv).
        time_column: the time column (parquet, csv); ``None``: the input order is the time.
        action_column: an optional action column: integers >= 0 are kept, strings are numbered in
            ascending order (their values go into the metadata's ``action_values``).
        id_type: ``auto`` (integers stay int64, anything else is a string), ``int`` or ``string``.
        min_item_count: items with fewer events share the out-of-vocabulary row (counted).
        memory_limit, temp_directory, threads, max_temp_size: DuckDB's settings (``threads`` ``None``: every core). ``temp_directory``
            ``None``: ``OUTPUT/.prepare-tmp`` (removed at the end).
        row_group_events: a row group closes once it holds this many events (plus one user).
        file_events: a user file closes once it holds this many events.
        on_bad_line: ``error`` (default) or ``skip`` (skipped lines are counted and logged).
        csv_delimiter, csv_header: the CSV dialect.
        overwrite: replace an existing prepared directory.
    """

    inputs: tuple[str, ...]
    output: str
    input_format: str = "auto"
    user_column: str = "user_id"
    item_column: str = "item_id"
    time_column: str | None = None
    action_column: str | None = None
    id_type: str = "auto"
    min_item_count: int = 1
    memory_limit: str = "2GB"
    temp_directory: str | None = None
    threads: int | None = None
    max_temp_size: str | None = None
    row_group_events: int = 1_000_000
    file_events: int = 50_000_000
    on_bad_line: str = "error"
    csv_delimiter: str = ","
    csv_header: bool = True
    overwrite: bool = False

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> PrepareError:
            return PrepareError(f"{name}={getattr(self, name)!r}: {rule}.")

        if isinstance(self.inputs, str) or not self.inputs or not all(isinstance(i, str) and i for i in self.inputs):
            raise fail("inputs", "must be a non-empty sequence of file names, directories or globs")
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not self.output:
            raise fail("output", "must name the prepared directory")
        for name, allowed in (("input_format", INPUT_FORMATS), ("id_type", ID_TYPES), ("on_bad_line", ON_BAD_LINE)):
            if getattr(self, name) not in allowed:
                raise fail(name, f"must be one of {allowed}")
        for name in ("user_column", "item_column"):
            if not getattr(self, name):
                raise fail(name, "must name a column")
        if self.input_format in TEXT_FORMATS and (self.time_column is not None or self.action_column is not None):
            raise PrepareError(f"input_format={self.input_format!r} has no columns: its line order is the time; drop time_column/action_column.")
        for name, low, high in (("min_item_count", 1, None), ("row_group_events", 1, _MAX_ROW_GROUP_EVENTS), ("file_events", 1, None)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
                raise fail(name, f"must be an integer >= {low}" + (f" and <= {high}" if high else ""))
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1):
            raise fail("threads", "must be an integer >= 1 (or None: every core)")
        for name in ("memory_limit", "max_temp_size"):
            value = getattr(self, name)
            if value is not None and not _SIZE.match(value):
                raise fail(name, "must be a size such as 2GB, 512MiB or 100GB")
        if len(self.csv_delimiter) != 1:
            raise fail("csv_delimiter", "must be one character")


def _delimiter(config: PrepareConfig, files: list[str]) -> str:
    """The CSV delimiter: ``.tsv`` files are tab-separated unless ``csv_delimiter`` says otherwise."""
    if config.csv_delimiter == "," and all(re.sub(r"\.(gz|zst|zstd)$", "", f.lower()).endswith(".tsv") for f in files):
        return "\t"
    return config.csv_delimiter


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _package_version() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("lightning-recsys")
    except Exception:  # noqa: BLE001 (an uninstalled checkout)
        return "unknown"


def _prepare_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise PrepareError(f"--output {output}: exists and is not a directory.")
    if output.is_dir() and any(output.iterdir()):
        if not overwrite:
            raise PrepareError(f"--output {output}: not empty; use --overwrite to replace a prepared directory there.")
        if not (output / METADATA_FILE).is_file() and not (output / USERS_DIR).is_dir():
            raise PrepareError(f"--output {output}: not empty and not a prepared directory; --overwrite only replaces prepared directories.")
        for name in (METADATA_FILE, ITEMS_FILE):
            (output / name).unlink(missing_ok=True)
        shutil.rmtree(output / USERS_DIR, ignore_errors=True)
    output.mkdir(parents=True, exist_ok=True)


class _Phases:
    """Logs each phase with its duration (the progress a user sees on a long run)."""

    def __init__(self, report: Callable[[str], None]) -> None:
        self.report, self.start = report, time.perf_counter()
        self._phase_start = self.start

    def done(self, message: str) -> None:
        now = time.perf_counter()
        self.report(f"prepare: {message} ({now - self._phase_start:.1f} s; {now - self.start:.1f} s in all)")
        self._phase_start = now


def prepare(config: PrepareConfig, report: Callable[[str], None] | None = None) -> PreparedMetadata:
    """Run ``prepare`` (see the module docstring); returns the metadata it wrote. ``report`` gets the progress lines."""
    require_duckdb()
    from lightning_recsys.data.parquet.prepare_sql import build_vocabulary, sorted_events  # noqa: PLC0415
    from lightning_recsys.data.parquet.prepare_write import UserFileWriter, user_schema  # noqa: PLC0415

    say = report if report is not None else log.info
    phases = _Phases(say)
    files = expand_inputs(config.inputs)
    input_format = detect_format(files) if config.input_format == "auto" else config.input_format
    output = Path(config.output)
    _prepare_output(output, config.overwrite)
    own_temp = config.temp_directory is None
    temp = Path(config.temp_directory) if config.temp_directory is not None else output / ".prepare-tmp"
    temp.mkdir(parents=True, exist_ok=True)
    database = temp / f"prepare-{time.time_ns()}.duckdb"
    con = connect(database, temp, config.memory_limit, config.threads, config.max_temp_size)
    try:
        try:
            if input_format in TEXT_FORMATS:
                source = stage_text_source(con, files, input_format, config.id_type, config.on_bad_line)
            else:
                columns = Columns(config.user_column, config.item_column, config.time_column, config.action_column)
                source = stage_table_source(
                    con, files, input_format, columns, config.id_type, config.on_bad_line, _delimiter(config, files), config.csv_header
                )
            if source.skipped_lines:
                say(f"prepare: skipped {source.skipped_lines} malformed line(s) (--on-bad-line skip)")
            if source.blank_lines:
                say(f"prepare: skipped {source.blank_lines} blank line(s)")
            phases.done(f"read {len(files)} {input_format} file(s)")
            vocabulary = build_vocabulary(con, config.min_item_count, source, output / ITEMS_FILE)
            phases.done(
                f"{vocabulary.num_events} events, {vocabulary.size} items in the vocabulary, "
                f"{vocabulary.oov_items} items ({vocabulary.oov_events} events) out of it; wrote {ITEMS_FILE}"
            )
            schema = user_schema(source.user_type, source.action_type is not None, source.time_type is not None)
            total = vocabulary.num_events
            last_report = [time.perf_counter()]

            def progress(events: int) -> None:
                if time.perf_counter() - last_report[0] >= 10.0:
                    last_report[0] = time.perf_counter()
                    say(f"prepare: wrote {events}/{total} events ({100.0 * events / total:.0f}%)")

            writer = UserFileWriter(output, schema, config.row_group_events, config.file_events, progress=progress)
            for batch in sorted_events(con, source, vocabulary, batch_rows=min(config.row_group_events, 1 << 20)):
                writer.add_events(batch)
            files_written = writer.close()
        except PrepareError:
            raise
        except Exception as error:
            translated = translate_error(error, temp, config.memory_limit)
            if translated is error:
                raise
            raise translated from error
        oov = vocabulary.oov_items > 0
        metadata = PreparedMetadata(
            num_items=vocabulary.size + (1 if oov else 0),
            oov_row=vocabulary.size if oov else None,
            oov_items=vocabulary.oov_items,
            oov_events=vocabulary.oov_events,
            num_users=sum(f.num_rows for f in files_written),
            num_events=sum(f.num_events for f in files_written),
            users_with_one_event=sum(g.short_users[0] for f in files_written for g in f.row_groups),
            num_action_types=vocabulary.num_action_types,
            user_id_type=source.user_type,
            has_actions=source.action_type is not None,
            has_timestamps=source.time_type is not None,
            files=tuple(files_written),
            prepared_by=PreparedBy(
                tool=PREPARE_TOOL,
                package_version=_package_version(),
                inputs=tuple(str(Path(i).resolve()) if Path(i).exists() else i for i in config.inputs),
                input_format=input_format,
                min_item_count=config.min_item_count,
                time_column=config.time_column,
                ties=TIES_INPUT_ORDER,
                created=_now(),
            ),
            action_values=vocabulary.action_values,
        )
        if metadata.num_events != vocabulary.num_events:
            raise PrepareError(f"internal check failed: wrote {metadata.num_events} events, but the inputs hold {vocabulary.num_events}.")
        write_metadata(output, metadata)
        phases.done(
            f"wrote {metadata.num_users} users ({metadata.users_with_one_event} with one event) in {len(files_written)} file(s), "
            f"{sum(len(f.row_groups) for f in files_written)} row group(s) to {output}"
        )
        return metadata
    finally:
        closing = time.perf_counter()
        con.close()
        database.unlink(missing_ok=True)
        database.with_name(database.name + ".wal").unlink(missing_ok=True)
        if own_temp:
            shutil.rmtree(temp, ignore_errors=True)
        log.debug("prepare: closed DuckDB and removed %s in %.1f s", temp, time.perf_counter() - closing)

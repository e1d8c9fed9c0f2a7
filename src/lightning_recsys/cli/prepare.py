"""``lightning-recsys prepare``: raw events in, a prepared directory of per-user parquet out (contract v1).

    lightning-recsys prepare --input 'events/*.parquet' --output prepared --time-column ts
    lightning-recsys prepare --input beauty.txt --input-format user-item-lines --output beauty
    lightning-recsys prepare --describe prepared_by_spark/
    lightning-recsys prepare --synthetic-events 10000000 --output-raw raw/events.parquet --string-ids

The contract, the flags and the grouping query for other engines: docs/datasets.md, "Prepared
parquet data (contract v1)".
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from lightning_recsys.data.parquet.contract import PreparedDataError

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-recsys prepare",
        description="Group raw events by user into a prepared directory (per-user parquet, items.parquet, metadata.json) "
        "with DuckDB, out of core; or describe user files another engine wrote; or generate synthetic raw events.",
    )
    mode = parser.add_argument_group("what to do (one of)")
    mode.add_argument("--input", action="extend", nargs="+", default=None, metavar="PATH", help="raw event files, directories or globs (repeatable); with --output")
    mode.add_argument("--describe", default=None, metavar="DIR", help="scan DIR/users/*.parquet written by another engine and write DIR/metadata.json")
    mode.add_argument("--synthetic-events", type=int, default=None, metavar="N", help="write N synthetic raw events to --output-raw")

    prep = parser.add_argument_group("prepare")
    prep.add_argument("--output", default=None, metavar="DIR", help="the prepared directory to write")
    prep.add_argument("--input-format", default="auto", choices=("auto", "parquet", "csv", "user-item-lines", "user-items-lines"))
    prep.add_argument("--user-column", default="user_id")
    prep.add_argument("--item-column", default="item_id")
    prep.add_argument("--time-column", default=None, help="default: none; the input order is the time")
    prep.add_argument("--action-column", default=None)
    prep.add_argument("--id-type", default="auto", choices=("auto", "int", "string"), help="auto: integer ids stay int64, others are strings")
    prep.add_argument("--min-item-count", type=int, default=1, help="rarer items share one out-of-vocabulary row (default 1: none)")
    prep.add_argument("--memory-limit", default="2GB", help="DuckDB's memory limit (default 2GB); it spills to --temp-directory past it")
    prep.add_argument("--temp-directory", default=None, help="DuckDB's spill directory (default: OUTPUT/.prepare-tmp, removed at the end)")
    prep.add_argument("--max-temp-size", default=None, help="the most DuckDB may spill (default: DuckDB's, most of the disk)")
    prep.add_argument("--threads", type=int, default=None, help="DuckDB threads (default: every core)")
    prep.add_argument("--row-group-events", type=int, default=1_000_000, help="events per row group of the user files (default 1e6)")
    prep.add_argument("--file-events", type=int, default=50_000_000, help="events per user file (default 5e7)")
    prep.add_argument("--on-bad-line", default="error", choices=("error", "skip"), help="malformed CSV/text lines: fail (default) or skip and count")
    prep.add_argument("--csv-delimiter", default=",", help="default ',' (a tab for .tsv files); '\\t' is a tab")
    prep.add_argument("--no-csv-header", dest="csv_header", action="store_false", help="CSV files have no header line")
    prep.add_argument("--overwrite", action="store_true", help="replace a prepared directory at --output")

    desc = parser.add_argument_group("--describe")
    desc.add_argument("--oov-items", type=int, default=0, help="items the writer sent to the OOV row (not visible in the user files)")

    synth = parser.add_argument_group("--synthetic-events")
    synth.add_argument("--output-raw", default=None, metavar="FILE.parquet", help="the raw event file to write")
    synth.add_argument("--num-items", type=int, default=1_000_000)
    synth.add_argument("--mean-length", type=float, default=9.0, help="mean history length (9: Amazon Beauty-like; 200: long)")
    synth.add_argument("--length-sigma", type=float, default=1.0, help="sigma of the lognormal history lengths")
    synth.add_argument("--max-length", type=int, default=5_000)
    synth.add_argument("--zipf-exponent", type=float, default=1.1)
    synth.add_argument("--string-ids", action="store_true", help="string user and item ids (default: integers)")
    synth.add_argument("--seed", type=int, default=0)
    return parser


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    modes = [name for name in ("input", "describe", "synthetic_events") if getattr(args, name) is not None]
    if len(modes) != 1:
        parser.error("give exactly one of --input (with --output), --describe DIR, --synthetic-events N (with --output-raw)")
    if args.describe is not None:
        from lightning_recsys.data.parquet.describe import describe_directory  # noqa: PLC0415

        metadata = describe_directory(args.describe, oov_items=args.oov_items, report=print)
        print(f"wrote {args.describe}/metadata.json: {metadata.num_users} users, {metadata.num_events} events, {metadata.num_items} items")
        return 0
    if args.synthetic_events is not None:
        if args.output_raw is None:
            parser.error("--synthetic-events needs --output-raw FILE.parquet")
        from lightning_recsys.data.parquet.synthetic_events import SyntheticEventsConfig, generate_events  # noqa: PLC0415

        config = SyntheticEventsConfig(
            num_events=args.synthetic_events, num_items=args.num_items, mean_length=args.mean_length, length_sigma=args.length_sigma,
            max_length=args.max_length, zipf_exponent=args.zipf_exponent, string_ids=args.string_ids, seed=args.seed,
        )
        start = time.perf_counter()
        counts = generate_events(args.output_raw, config)
        print(f"wrote {counts['events']} events of {counts['users']} users to {args.output_raw} in {time.perf_counter() - start:.1f} s")
        return 0
    if args.output is None:
        parser.error("--input needs --output DIR")
    from lightning_recsys.data.parquet.prepare import PrepareConfig, prepare  # noqa: PLC0415

    config = PrepareConfig(
        inputs=tuple(args.input), output=args.output, input_format=args.input_format, user_column=args.user_column,
        item_column=args.item_column, time_column=args.time_column, action_column=args.action_column, id_type=args.id_type,
        min_item_count=args.min_item_count, memory_limit=args.memory_limit, temp_directory=args.temp_directory,
        threads=args.threads, max_temp_size=args.max_temp_size, row_group_events=args.row_group_events,
        file_events=args.file_events, on_bad_line=args.on_bad_line, csv_delimiter="\t" if args.csv_delimiter == "\\t" else args.csv_delimiter,
        csv_header=args.csv_header, overwrite=args.overwrite,
    )
    prepare(config, report=lambda line: print(line, flush=True))
    return 0


def prepare_main(argv: list[str]) -> int:
    """Entry point of ``lightning-recsys prepare``; returns the exit code (0 ok, 1 bad input, 2 usage)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _run(args, parser)
    except (PreparedDataError, ImportError) as error:
        print(f"lightning-recsys prepare: error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:  # a config's checks (they name the argument, its value and the rule)
        print(f"lightning-recsys prepare: error: {error}", file=sys.stderr)
        return 2

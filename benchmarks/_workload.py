"""The workload options shared by the emulated-cluster driver and the job it launches in each namespace."""

from __future__ import annotations

import argparse

WORKLOAD_OPTIONS: tuple[str, ...] = (
    "warmup_steps", "steps", "global_batch_size", "tables", "table_rows", "embedding_dim", "pooling_factor", "zipf_exponent",
)  # fmt: skip


def positive_row_counts(text: str, option: str, example: str) -> list[int]:
    """A comma-separated list of positive row counts (``1e6`` allowed); ``option`` and ``example`` name it in the error."""
    try:
        rows = [int(float(x)) for x in str(text).split(",") if x.strip()]
    except ValueError:
        rows = []
    if not rows or any(r < 1 for r in rows):
        raise ValueError(f"{option}={text!r} must be a positive row count or a comma-separated list of them (e.g. {example}).")
    return rows


def table_sizes(table_rows: str, tables: int) -> list[int]:
    """``--table-rows`` ("100000" or "1000000,100000,...") cycled over ``tables`` tables."""
    rows = positive_row_counts(table_rows, "--table-rows", "1e6,1e5")
    return [rows[i % len(rows)] for i in range(tables)]


def add_workload_arguments(parser: argparse.ArgumentParser, *, table_rows: str, steps_help: str) -> None:
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24, help=steps_help)
    parser.add_argument("--global-batch-size", type=int, default=4096)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument(
        "--table-rows", default=table_rows, help=f"rows per table, or a comma-separated list cycled over the tables (default {table_rows})"
    )
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--pooling-factor", type=float, default=2.0, help="mean ids per example and feature")
    parser.add_argument("--zipf-exponent", type=float, default=1.05, help="skew of the ids (SyntheticClickLogConfig.zipf_exponent)")


def workload_argv(args: argparse.Namespace) -> list[str]:
    """The workload options of ``args`` as command-line arguments, to pass them on."""
    return [item for name in WORKLOAD_OPTIONS for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]

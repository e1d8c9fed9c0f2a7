"""The workload options shared by the emulated-cluster driver and the job it launches in each namespace."""

from __future__ import annotations

import argparse

WORKLOAD_OPTIONS: tuple[str, ...] = ("warmup_steps", "steps", "global_batch_size", "tables", "table_rows", "embedding_dim")


def add_workload_arguments(parser: argparse.ArgumentParser, *, table_rows: int, steps_help: str) -> None:
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24, help=steps_help)
    parser.add_argument("--global-batch-size", type=int, default=4096)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--table-rows", type=int, default=table_rows)
    parser.add_argument("--embedding-dim", type=int, default=64)


def workload_argv(args: argparse.Namespace) -> list[str]:
    """The workload options of ``args`` as command-line arguments, to pass them on."""
    return [item for name in WORKLOAD_OPTIONS for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]

"""``python -m lightning_recsys.data.criteo.to_npy IN... --out-dir DIR``: Criteo TSV/gzip to TorchRec's npy files.

One input file per day; see ``lightning_recsys.data.criteo.binary.convert_tsv_to_npy``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

from lightning_recsys.data.criteo.binary import convert_tsv_to_npy, day_file, input_file_problem


def _day_numbers(paths: Sequence[str], days: Sequence[int] | None) -> list[int]:
    if days is not None:
        if len(days) != len(paths):
            raise SystemExit(f"--days has {len(days)} numbers for {len(paths)} input files; give one per file.")
        numbers = list(days)
        negative = [d for d in numbers if d < 0]
        if negative:
            # day_-1_*.npy would be written, and CriteoBinaryDataModule's *_days (day numbers >= 0) never reads it.
            raise SystemExit(f"--days {' '.join(map(str, numbers))}: day numbers must be >= 0 (got {negative}).")
    else:
        found = [re.search(r"day_(\d+)", Path(p).name) for p in paths]
        if any(found) and not all(found):
            # Numbering all inputs 0, 1, ... here wrote day_3.gz as day 0 (over any day_0 files already there).
            unnamed = ", ".join(p for p, m in zip(paths, found) if m is None)
            raise SystemExit(
                f"{unnamed}: no day_N in the name, while other inputs have one; rename it, or number every input with --days."
            )
        numbers = [int(m.group(1)) for m in found] if all(found) else list(range(len(paths)))  # type: ignore[union-attr]
    # One day's npy files per input: a repeated day would be overwritten by the later input.
    for day in sorted(set(numbers)):
        same = [p for p, d in zip(paths, numbers) if d == day]
        if len(same) > 1:
            raise SystemExit(
                f"day {day} twice: {', '.join(same)} would all be written to day_{day}_*.npy, each input over the one "
                "before; concatenate them into one input, or number them with --days."
            )
    return numbers


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lightning_recsys.data.criteo.to_npy IN... --out-dir DIR``: TSV/gzip to TorchRec's npy files."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_recsys.data.criteo.to_npy",
        description="Convert Criteo TSV files (plain or gzip) into TorchRec's day_{i}_{dense,sparse,labels}.npy files.",
    )
    parser.add_argument("inputs", nargs="+", help="TSV or gzip files, one per day")
    parser.add_argument("--out-dir", required=True, help="directory for the npy files")
    parser.add_argument(
        "--days", type=int, nargs="+", default=None,
        help="day number of each input (default: the N of day_N in the file names, else 0, 1, ...)",
    )
    parser.add_argument("--on-bad-line", choices=["error", "skip"], default="error")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    # Every input is checked first: a misspelled last one was found after converting all the others (hours).
    for path in args.inputs:
        if (problem := input_file_problem(path)) is not None:
            raise SystemExit(f"{path}: the input {problem}; fix the path (nothing was converted).")
    for path, day in zip(args.inputs, _day_numbers(args.inputs, args.days)):
        rows = convert_tsv_to_npy(path, args.out_dir, day, on_bad_line=args.on_bad_line, progress=not args.no_progress)
        print(f"{path} -> {day_file(args.out_dir, day, '{dense,sparse,labels}')}: {rows} rows")


if __name__ == "__main__":
    main()

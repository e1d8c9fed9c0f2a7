"""Helpers for the RunSummary tests: read the printed table back, write a small Criteo TSV with malformed lines."""

from __future__ import annotations

import re
from pathlib import Path


def summary_rows(text: str) -> dict[str, str]:
    """``format_summary``'s table as {row name: value} (names and values are separated by 2+ spaces)."""
    rows = [re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in text.splitlines()[1:]]
    return {row[0]: row[1] if len(row) > 1 else "" for row in rows}


def write_criteo_tsv(path: Path, *, good: int, bad_at: tuple[int, ...] = ()) -> str:
    """``good`` valid Criteo lines, with a malformed line inserted before each of the positions ``bad_at``."""
    lines = ["\t".join([str(i % 2), str(i)] + [""] * 12 + [f"{i:08x}"] * 26) for i in range(good)]
    for position in sorted(bad_at, reverse=True):
        lines.insert(position, "junk")
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)

"""`make demo`'s output prints each line once (issue: every Lightning log line appeared twice).

FBGEMM's import and TorchRec's planning used to give the root logger a handler (``lightning_recsys._upstream_logging``
says where), and Lightning's loggers propagate to it, so each Lightning line came once from Lightning's handler and
once from the root's (``INFO:lightning.fabric.utilities.seed:Seed set to 0``).
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "examples" / "configs" / "synthetic_dlrm.yaml"  # what `make demo` runs (Makefile)


def repeated_lines(output: str) -> dict[str, int]:
    """Lines printed more than once. Lines without a letter or digit (blank lines, the ``----`` rules that open and
    close Lightning's one "All distributed processes registered" message) are layout, not repeats."""
    counts = collections.Counter(line.rstrip() for line in output.splitlines() if re.search(r"[A-Za-z0-9]", line))
    return {line: n for line, n in counts.items() if n > 1}


def test_repeated_lines_are_found():
    doubled = "INFO: Seed set to 0\nINFO:lightning.fabric.utilities.seed:Seed set to 0\nEpoch 0\nEpoch 0\n----\n----\n"
    assert repeated_lines(doubled) == {"Epoch 0": 2}


@pytest.mark.slow
def test_demo_prints_no_line_twice(tmp_path):
    """The demo's CLI and config on 2 processes, for 3 steps; rank 1's own lines differ by their rank."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_recsys.cli", "fit", "--config", str(DEMO_CONFIG),
         "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    output = result.stdout + result.stderr
    assert "Seed set to 0" in output and "TwoDRecStrategy: 1D sharding over 2 ranks" in output  # the lines that were doubled
    assert "INFO:lightning" not in output, "a root-logger handler printed Lightning's lines (the basicConfig format)"
    assert not repeated_lines(output), f"lines printed more than once: {repeated_lines(output)}"

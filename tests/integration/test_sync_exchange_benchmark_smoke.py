"""benchmarks/sync_exchange.py runs end to end (two processes, one timed sync), so it cannot rot between the runs that publish numbers."""

import re
import sys
from pathlib import Path

import pytest
from lightning_recsys.testing.commands import run_command
from lightning_recsys.testing.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_the_sync_exchange_benchmark_prints_its_phases_and_row_counts(tmp_path):
    command = [str(ROOT / "benchmarks" / "sync_exchange.py"), "--touched", "300", "--syncs", "1", "--port", str(free_port())]
    proc = run_command(command, cwd=tmp_path, timeout=300, check=False)[0]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = re.search(r"fp8, 3 pieces: launch ([\d.]+) ms, send ([\d.]+) ms, apply ([\d.]+) ms per sync \(median of 1\); "
                     r"rows per replica ([\d,]+), union ([\d,]+)", proc.stdout)
    assert line, proc.stdout
    own, union = (int(line.group(i).replace(",", "")) for i in (4, 5))
    assert 0 < own <= 8 * 300 and own < union <= 2 * own  # two replicas' different draws: a union larger than either

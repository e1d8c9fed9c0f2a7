"""benchmarks/readers.py runs end to end on a tiny file, so it cannot rot between the runs that publish numbers."""

import json
import sys
from pathlib import Path

import pytest
from lightning_recsys.testing.commands import run_command

ROOT = Path(__file__).resolve().parents[2]


def test_readers_benchmark_runs_on_a_tiny_file(tmp_path):
    out = tmp_path / "readers.json"
    proc = run_command(
        [str(ROOT / "benchmarks" / "readers.py"), "--lines", "5000", "--python-lines", "3000",
         "--workers", "0", "1", "--json", str(out)],
        cwd=tmp_path, timeout=300, check=False,
    )[0]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {(r["reader"], r["num_workers"]): r for r in result["runs"]}
    assert set(runs) == {(reader, w) for reader in ("python", "arrow", "arrow_gzip", "npy") for w in (0, 1)}
    # 5000 lines: two batches of 2048; the python reader reads the first 3000 lines, one batch.
    assert runs[("arrow", 0)]["examples"] == runs[("npy", 1)]["examples"] == 4096
    assert runs[("python", 0)]["examples"] == 2048 and runs[("arrow_gzip", 1)]["examples"] == 4096
    assert all(r["lines_per_s"] > 0 and r["terabyte_epoch_hours"] > 0 for r in runs.values())
    stages = result["arrow_stage_profile"]["cpu_seconds_per_1e6_lines"]
    assert result["arrow_stage_profile"]["lines"] == 5000 and stages["pyarrow_read_csv"] > 0
    assert stages["total"] == pytest.approx(sum(v for k, v in stages.items() if k != "total"), abs=0.01)
    assert result["npy_conversion"]["lines"] == 5000 and result["summary"]["arrow_over_python_default"] > 0

"""benchmarks/data_scale.py runs end to end on a tiny data set and reports every rank's numbers."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_recsys.testing.commands import run_command

ROOT = Path(__file__).resolve().parents[2]


def test_data_scale_reports_each_rank_of_each_world(tmp_path):
    command = [str(ROOT / "benchmarks" / "data_scale.py"), "--events", "200000", "--worlds", "2", "--lengths", "beauty",
               "--items", "5000", "--root", str(tmp_path), "--fill", "--seconds", "2"]
    proc = run_command(command, cwd=ROOT, timeout=300, check=False)[0]
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    assert [(r["world_size"], r["rank"]) for r in rows] == [(2, 0), (2, 1)]
    for row in rows:
        assert row["epochs"] >= 2 and row["batches"] >= 2 * row["batches_per_epoch"] > 0  # --fill: epochs until --seconds
        assert 0 < row["bytes_read"] < row["total_bytes"]  # the first epoch's reads, not every epoch's
        assert row["events"] > 0 and row["first_batch_s"] > 0
    assert sum(r["events"] for r in rows) >= 2 * 200_000  # every user read in each epoch
    assert not list(tmp_path.iterdir())  # the generated directory is removed without --keep


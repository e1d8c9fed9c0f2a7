"""benchmarks/full_ranking_scale.py at a tiny size (10^4 items, 40 users, 2 processes): the table built on meta,
sharded, filled, then ranked; every rank's target ranks and top-K ids equal the brute force over the whole table,
and the Markdown table and the JSON report what they should."""

import json
import re
import sys
from pathlib import Path

import pytest
from lightning_recsys.testing.commands import run_command
from lightning_recsys.testing.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two spawned processes that import torchrec: ~1 minute on 2 busy cores


# Row-wise only (the benchmark's default): column-wise ranking is checked against the brute force in
# test_full_ranking_integration.py, and each run here costs a minute of the suite.
@pytest.mark.parametrize("sharding", ["row_wise"])
def test_the_scale_benchmark_ranks_as_the_brute_force_and_reports(tmp_path: Path, sharding: str) -> None:
    out = tmp_path / "result.json"
    command = [
        str(ROOT / "benchmarks" / "full_ranking_scale.py"), "--items", "10000", "3000", "--users", "40",
        "--sharding", sharding, "--repeats", "1", "--block-bytes", "16000", "--check", "--port", str(free_port()), "--out", str(out),
    ]
    proc = run_command(command, cwd=tmp_path, timeout=400, check=False)[0]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "check: every rank and top-K id equals the brute force" in proc.stdout, proc.stdout
    assert re.search(r"\| 10,000 \| [\d.]+ \| [\d.]+ \| [\d,]+ \| [\d.]+ \| [\d,]+ \| \d+, \d+ \|", proc.stdout), proc.stdout
    summary = json.loads(out.read_text())
    assert summary["check_problems"] == []
    assert [row["items"] for row in summary["rows"]] == [10_000, 3000]
    row = summary["rows"][0]
    assert row["rows_per_chunk"] == 100  # 16,000 bytes of scores for 40 queries
    # dim 64 (beauty_pretrain.yaml) fp32: each rank holds half of the 10^4 rows (row-wise) or of the columns.
    assert sum(row["table_mib_per_rank"]) == pytest.approx(10_000 * 64 * 4 / 2**20)
    assert summary["config"]["dim"] == 64 and summary["config"]["k"] == 100
    for op in ("target_ranks", "top_k"):
        assert row[op]["median_s"] > 0 and row[op]["users_per_s"] == pytest.approx(40 / row[op]["median_s"])
        assert all(0 <= mib < 256 for mib in row[op]["extra_peak_mib_per_rank"])

"""benchmarks/_quality_job.py, the run behind time_to_quality.py, at a tiny size on 2 processes of one node:
every rank stops together at the first validation that reaches the threshold, and the clock leaves validation out."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--set=data.num_users=128", "--set=data.num_items=64", "--set=data.global_batch_size=16", "--set=data.num_negatives=16",
        "--set=model.embedding_dim=8", "--set=model.init_args.encoder.init_args.num_layers=1"]  # fmt: skip


def _job(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "benchmarks" / "_quality_job.py"), "--out", str(out), "--devices", "2", "--num-nodes", "1",
               "--sharding-group-size", "2", *TINY, *args]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_job_stops_at_the_first_validation_that_reaches_the_threshold(tmp_path):
    result = _job(tmp_path, "--max-steps", "12", "--eval-every", "4", "--threshold", "0.0", "--qcomms", "fp8", "--index-dedup")
    assert result["steps_run"] == 4 and len(result["points"]) == 1  # 0.0 is reached at once: no rank trains on
    reached = result["reached"]
    assert reached["step"] == 4 and 0 < reached["train_s"] < reached["wall_s"]
    assert result["bytes_per_step_rank0"]["total"] > 0 and result["bytes_per_step_rank0"]["inter_node"] == 0  # one node

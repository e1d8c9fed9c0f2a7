"""benchmarks/overhead.py --workload pretrain runs at a tiny size (CPU, 2 processes), so it cannot rot between the runs that publish numbers."""

import json
import sys
from pathlib import Path

import pytest
from lightning_recsys.testing.commands import run_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_overhead_pretrain_measures_tokens_per_second_and_profiles_the_fit_and_plain_pytorch(tmp_path):
    command = [
        str(ROOT / "benchmarks" / "overhead.py"), "--workload", "pretrain", "--global-batch", "8",
        "--num-items", "256", "--num-users", "64", "--num-negatives", "32", "--steps", "5", "--warmup", "2", "--repeats", "1",
        "--variants", "raw", "raw_pipeline", "lightning", "plain", "--profile-steps", "2",
        "--json", str(tmp_path / "overhead.json"),
    ]
    proc = run_command(command, cwd=tmp_path, timeout=900, check=False)[0]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "overhead.json").read_text())["8"]
    assert result["setup"]["mean_tokens_per_step"] > 0 and result["setup"]["baseline"] == "raw"
    variants = result["variants"]
    assert set(variants) == {"raw", "raw_pipeline", "lightning", "plain"}
    assert all(row["median_tokens_per_s"] > 0 and row["median_tokens_per_cpu_s"] > 0 for row in variants.values())
    assert variants["raw"]["ratio_to_baseline"] == 1.0 and variants["plain"]["ratio_to_plain"] == 1.0
    fit, plain = result["profile"]["lightning"], result["profile"]["plain"]
    assert fit["all-to-all (input dist, embeddings fwd + bwd)"] > 0 and plain["all-to-all (input dist, embeddings fwd + bwd)"] == 0
    for row in ("lookup", "encoder", "loss", "optimizer"):
        name = next(n for n in fit if n.startswith(row))
        assert fit[name] > 0 and plain[name] > 0, name
    assert "| lightning |" in proc.stdout and "| plain |" in proc.stdout and "Tokens = " in proc.stdout

"""benchmarks/emulated_cluster.py --workload pretrain, very small: the cost model's prediction, then the measurement beside it.

Needs root, iproute2 and network namespaces; skips with the reason otherwise.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lightning_recsys.testing.network_namespaces import namespace_skip_reason

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "emulated_cluster.py"
SKIP = namespace_skip_reason("create network namespaces and tc qdiscs")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(SKIP is not None, reason=str(SKIP))]


def test_tiny_pretrain_workload_predicts_measures_and_counts_repeats(tmp_path):
    out = tmp_path / "ec.json"
    args = ["--workload", "pretrain", "--configs", "1d_dedup_fp32", "--items", "5000", "--pretrain-users", "600", "--embedding-dim", "16",
            "--num-negatives", "32", "--max-length", "20", "--global-batch-size", "64", "--warmup-steps", "2", "--steps", "2",
            "--run-timeout", "60", "--repeats", "1", "--json", str(out), "--no-png"]  # fmt: skip
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert output.index("Cost model, before the run") < output.index("1d_dedup_fp32 ") < output.index("Cost model vs measured")
    assert "held in" in output and "of 1 repeats" in output
    result = json.loads(out.read_text())
    assert result["model"]["workload"] == "pretrain" and result["model"]["learned"]["tokens_per_example"] > 0
    (entry,) = result["configs"]
    assert entry["index_dedup"] and 0 < entry["cluster"]["unique_id_fraction_rank0"]["item"] < 1
    split = entry["cluster"]["sequence_all_to_all_by_feature_rank0"]
    assert set(split) == {"item_id", "next_item_id", "negative_item_id"}
    embeddings = [r for r in entry["cluster"]["traffic_per_step_rank0"] if r["purpose"] == "embeddings"]
    assert sum(r["inter_node_bytes"] for r in embeddings) > 0  # 1D: the sequence all-to-all crosses the shaped link
    repeats = result["cost_model"]["repeats"]
    assert repeats["repeats"] == 1 and len(repeats["per_repeat"]) == 1
    assert all(0 <= held <= 1 for held in repeats["held"].values())

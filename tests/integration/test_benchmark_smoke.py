"""The benchmark scripts run (tiny sizes, CPU), so they cannot rot between the runs that publish numbers."""

import json
import sys
from pathlib import Path

import pytest
from lightning_recsys.testing.commands import run_command

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_throughput_script_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run_command(
        [str(ROOT / "benchmarks" / "gpu_throughput.py"), "--accelerator", "cpu", "--tiny", "--out", str(out)],
        cwd=tmp_path, timeout=180, check=False,
    )[0]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["global_steps"] == 6 and result["examples_per_sec"] > 0


@pytest.mark.slow
def test_cost_model_projections_compare_2d_against_the_best_1d_deduped_where_it_helps(tmp_path):
    out = tmp_path / "cost_model.json"
    proc = run_command(
        [str(ROOT / "benchmarks" / "cost_model.py"), "--no-measured", "--no-png", "--json", str(out)],
        cwd=tmp_path, timeout=600, check=False,
    )[0]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    sequence, pooled = result["workloads"]["sequence"], result["workloads"]["criteo_tb"]
    assert "deduped" in sequence["best_1d_8_nodes"]["config"]  # hot 256-id histories: dedup is 1D's best
    assert "deduped" not in pooled["best_1d_8_nodes"]["config"]  # pooled tables have no dedup
    for row in result["regime_sweep"]:
        assert row["best_1d_scaling"] >= row["best_1d_without_dedup_scaling"] - 1e-9
    assert "Best 1D at 8 nodes" in proc.stdout
    # Parts 5-6: the pretraining traffic model against exact counts of the emulated workload's batches, and its regime map.
    checks = result["pretrain_check"]
    assert {r["feature"] for r in checks} == {"item_id", "next_item_id", "negative_item_id"}
    assert all(abs(r["ratio"] - 1) <= 0.25 for r in checks), checks
    assert len(result["pretrain_regime"]) == 18 and "Pretraining regime map" in proc.stdout

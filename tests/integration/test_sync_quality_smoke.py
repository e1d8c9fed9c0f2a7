"""benchmarks/sync_quality.py end to end on a tiny synthetic click log (4 CPU processes as 2 nodes x 2)."""

import json
import sys
from pathlib import Path

import pytest
from lightning_recsys.testing.commands import run_command

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sync_quality.py"


@pytest.mark.slow
def test_sync_quality_script_scores_1d_and_2d_variants(tmp_path):
    out = tmp_path / "sync_quality.json"
    args = ["--variants", "1d", "2d-touched", "2d-touched-overlap-bf16", "--intervals", "2", "--steps", "8", "--val-batches", "2",
            "--global-batch", "64", "--rows", "300", "--tables", "2", "--json", str(out)]
    proc = run_command([str(SCRIPT), *args], cwd=tmp_path, timeout=400, check=False)[0]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["1d", "2d-touched", "2d-touched-overlap-bf16"]
    assert result["examples_per_run"] == 8 * 64 and result["val_examples"] == 2 * 64
    for name, r in runs.items():
        assert 0.0 <= r["val_auc"] <= 1.0 and r["val_ne"] > 0 and len(r["loss_curve"]) == 8, name
    assert runs["1d"]["syncs"] == 0 and runs["1d"]["every_n_steps"] is None
    for name in ("2d-touched", "2d-touched-overlap-bf16"):
        assert runs[name]["syncs"] == 4 and 0 < runs[name]["touched_fraction"] < 1, runs[name]
    assert "2d-touched-overlap-bf16" in proc.stdout and "dAUC" in proc.stdout

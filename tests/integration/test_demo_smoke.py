"""The `make demo` entry point, with tiny sizes, as a user runs it (Lightning launches rank 1)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_reports_metrics(tmp_path):
    metrics_file = tmp_path / "metrics.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_synthetic_dlrm.py"), "--tiny", "--metrics-json", str(metrics_file)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Validation after 1 epochs on 2 ranks: AUC=" in result.stdout
    metrics = json.loads(metrics_file.read_text())
    assert 0.0 <= metrics["val/auc"] <= 1.0
    assert metrics["val/ne"] > 0

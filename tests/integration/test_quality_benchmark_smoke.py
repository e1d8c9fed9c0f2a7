"""benchmarks/quality.py end to end on a small synthetic MovieLens-format directory (2 CPU processes)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "quality.py"


def _run(args, cwd):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_quality_script_trains_the_movielens_config_and_scores_the_baselines(tmp_path):
    data = tmp_path / "ml"
    _run(["--make-synthetic", str(data), "--synthetic-ratings", "3000"], tmp_path)
    assert sorted(p.name for p in data.iterdir()) == ["u.data", "u.item", "u.user", "u1.base", "u1.test"]
    assert len((data / "u1.test").read_text().splitlines()) == 600
    out = tmp_path / "quality.json"
    stdout = _run(
        ["--path", str(data), "--json", str(out), "--override", "--trainer.max_epochs", "1", "--data.global_batch_size", "128"],
        tmp_path,
    )
    result = json.loads(out.read_text())
    assert result["baselines"]["ratings"] == {"train": 2160, "val": 240, "test": 600}
    for name in ("popularity", "user_item_bias"):
        assert 0.0 <= result["baselines"][name]["test_auc"] <= 1.0 and result["baselines"][name]["test_ne"] > 0
    model = result["model"]
    assert model["world_size"] == 2 and model["epochs_run"] == 1 and 0.0 <= model["test"]["test/auc"] <= 1.0
    assert "user_item_bias" in stdout and "model" in stdout
    assert "split u1: train 2160, val 240 (a random draw of the base file), test 600 ratings" in stdout

"""benchmarks/quality.py end to end on a small synthetic MovieLens-format directory (2 CPU processes)."""

import json
import sys
from pathlib import Path

import pytest
from lightning_recsys.testing.commands import run_command

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "quality.py"


def _run(args, cwd):
    proc = run_command([str(SCRIPT), *args], cwd=cwd, timeout=400, check=False)[0]
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


@pytest.mark.slow
def test_quality_script_compares_the_sequence_config_with_dlrm_and_the_history_baselines(tmp_path):
    data = tmp_path / "ml"
    _run(["--make-synthetic", str(data), "--synthetic-ratings", "2000"], tmp_path)
    out = tmp_path / "sequence.json"
    tiny = "--trainer.max_epochs 1 --data.global_batch_size 128"
    stdout = _run(
        ["--path", str(data), "--sequence", "--seeds", "0", "--json", str(out), "--data-override", tiny,
         "--sequence-override", "--data.max_history_length 10 --model.init_args.max_history 10"],
        tmp_path,
    )
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"dlrm", "sequence"} and result["seeds"] == [0]
    for name in ("dlrm", "sequence"):
        (run,) = result["runs"][name]
        assert run["world_size"] == 2 and run["epochs_run"] == 1
        assert result["mean"][name]["auc"] == run["test"]["test/auc"] and result["mean"][name]["logloss"] > 0
    assert result["sequence_auc_gain"] == result["mean"]["sequence"]["auc"] - result["mean"]["dlrm"]["auc"]
    for name in ("recent_rate", "recent_rate_item"):
        baseline = result["baselines"][name]
        assert 0.0 <= baseline["test_auc"] <= 1.0 and baseline["test_logloss"] > 0 and baseline["window"] in (5, 10, 20, 50, None)
    assert "recent_rate_item" in stdout and "sequence - dlrm test AUC" in stdout


@pytest.mark.slow
def test_quality_script_runs_the_synthetic_sequence_comparison(tmp_path):
    out = tmp_path / "synthetic.json"
    tiny = (
        "--trainer.max_epochs 1 --data.init_args.global_batch_size 64 --data.init_args.train_batches 2 "
        "--data.init_args.val_batches 1 --data.init_args.test_batches 2"
    )
    stdout = _run(["--synthetic-sequence", "--json", str(out), "--data-override", tiny], tmp_path)
    result = json.loads(out.read_text())
    assert result["dataset"] == "synthetic-sequence" and set(result["runs"]) == {"dlrm", "sequence"}
    assert result["runs"]["dlrm"][0]["world_size"] == 2
    ceiling = result["baselines"]
    assert ceiling["planted_logit_auc"] > ceiling["context_only_auc"] > 0.5  # the history's share of the signal
    assert "planted logit AUC" in stdout

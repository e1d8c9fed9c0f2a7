"""Every example config runs a few tiny steps through the `lightning-recsys` console script (2 CPU processes);
`lightning-recsys plan` prints the plan report those runs log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from movielens_files import write_tiny_movielens
from lightning_recsys.testing.commands import run_cli
from lightning_recsys.testing.processes import run_torchrun_nodes

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
CLI = str(Path(sys.executable).with_name("lightning-recsys"))  # the console script, for the torchrun launches
TINY_SYNTHETIC = [
    "--trainer.max_epochs", "1",
    "--data.init_args.global_batch_size", "64",
    "--data.init_args.train_batches", "3",
    "--data.init_args.val_batches", "1",
]



def _fit(config: str, overrides: list[str], tmp_path: Path, output: list[str] | None = None) -> dict:
    summary = tmp_path / "summary.json"
    printed = run_cli(["fit", "--config", str(CONFIGS / config), "--summary-json", str(summary), *overrides], cwd=tmp_path, world_size=2)
    assert "Run summary" in printed
    if output is not None:
        output.append(printed)
    return json.loads(summary.read_text())


def _logged_plan(fit_output: str) -> tuple[str, str]:
    """The topology line and the plan report that TwoDRecStrategy logged at setup."""
    lines = fit_output.splitlines()
    topology = next(line.split("TwoDRecStrategy: ", 1)[1] for line in lines if "TwoDRecStrategy: " in line)
    start = next(i for i, line in enumerate(lines) if line.startswith("Sharding plan (") and "group-local ranks" not in line)
    stop = next(i for i in range(start, len(lines)) if lines[i].startswith("QComms (effective precisions):"))
    return topology, "\n".join(lines[start:stop]).strip()


@pytest.mark.parametrize("config", ["synthetic_dlrm.yaml", "dcn_synthetic.yaml"])
def test_synthetic_configs_train_and_plan_prints_the_logged_report(config, tmp_path):
    output: list[str] = []
    summary = _fit(config, TINY_SYNTHETIC, tmp_path, output)
    assert summary["world_size"] == 2 and summary["global_steps"] == 3
    assert 0.0 <= summary["metrics"]["val/auc"] <= 1.0 and summary["examples_per_sec"] > 0
    assert summary["val_metrics_step"] == 3  # the epoch-end validation, after the last step
    assert summary["bytes_per_step"]["payload"] > 0
    assert list(tmp_path.glob("lightning_logs/version_*/metrics.csv")), "the default CSV logger wrote nothing"

    topology, report = _logged_plan(output[0])
    planned = run_cli(["plan", "--config", str(CONFIGS / config), *TINY_SYNTHETIC], cwd=tmp_path, world_size=1)
    assert planned.splitlines()[0] == topology
    assert report in planned, f"training logged:\n{report}\n\n`lightning-recsys plan` printed:\n{planned}"


def test_movielens_config_trains_on_files_in_the_real_format(tmp_path):
    write_tiny_movielens(tmp_path)
    summary = _fit("movielens_dlrm.yaml", ["--data.path", str(tmp_path), "--data.global_batch_size", "32", "--trainer.max_epochs", "1"], tmp_path)
    assert summary["global_steps"] == 400 * 8 // 10 // 32  # train split: 80% of the ratings, whole global batches
    assert 0.0 <= summary["metrics"]["val/auc"] <= 1.0


def test_criteo_config_trains_on_a_gzip_file(tmp_path):
    import gzip

    lines = ["\t".join([str(i % 2)] + [str(i % 7)] * 13 + [f"{(i * 2654435761) % 2**32:08x}"] * 26) for i in range(96)]
    with gzip.open(tmp_path / "day_0.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    path = str(tmp_path / "day_0.gz")
    overrides = [
        "--data.train_paths", f"[{path}]", "--data.val_paths", f"[{path}]", "--data.global_batch_size", "16",
        "--data.table_sizes", "50", "--model.init_args.table_sizes", json.dumps([50] * 26),
    ]
    summary = _fit("criteo_dlrm.yaml", overrides, tmp_path)
    assert summary["global_steps"] == 96 // 16


@pytest.mark.slow
def test_two_node_config_runs_as_two_torchrun_launches(tmp_path):
    tiny = [
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_epochs", "1",
        "--trainer.strategy.init_args.sharding_group_size", "1",
        "--data.init_args.global_batch_size", "64", "--data.init_args.train_batches", "3",
        "--data.init_args.val_batches", "1", "--data.init_args.table_sizes", "[100, 100]",
        "--model.init_args.table_sizes", "[100, 100]",
    ]
    outputs = run_torchrun_nodes(
        [CLI, "fit", "--config", str(CONFIGS / "two_node_2d_fp8.yaml"), *tiny], nodes=2, nproc_per_node=1, cwd=tmp_path
    )
    assert "2D all_to_all_optimized: 2 replicas x sharding groups of 1 ranks" in outputs[0]
    assert "pooled_all_to_all: forward fp8_e4m3, backward bf16" in outputs[0]
    assert "Run summary" in outputs[0]

"""The CLI without training: config resolution (interpolation, both strategy spellings, data/model
agreement), the help listing every subcommand, and ``plan``."""

import json
from pathlib import Path

import pytest

from lightning_recsys import GuardConfig, PlanningConfig, ReplicaSyncConfig, TwoDRecStrategy
from lightning_recsys.cli import build_cli, main, plan_main
from lightning_recsys.data import MovieLens100KDataModule
from lightning_recsys.models import DCNRanker, DLRMRanker

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def _build(config: str, *overrides: str):
    return build_cli(["--config", str(CONFIGS / config), *overrides], run=False)


def test_interpolation_ties_the_model_to_the_data():
    cli = _build("synthetic_dlrm.yaml", "--data.init_args.train_batches", "3")
    assert isinstance(cli.model, DLRMRanker) and isinstance(cli.trainer.strategy, TwoDRecStrategy)
    assert cli.model.hparams.table_sizes == cli.datamodule.config.table_sizes == [1000] * 8
    assert cli.model.hparams.dense_arch_layer_sizes == [32, cli.model.hparams.embedding_dim]
    assert cli.datamodule.config.train_batches == 3
    assert cli.trainer.strategy.embedding_optimizer_config.lr == 0.1  # class_path/init_args spelling


def test_registered_name_spelling_gives_the_strategy_with_defaults():
    cli = _build("dcn_synthetic.yaml")
    assert isinstance(cli.model, DCNRanker)
    assert isinstance(cli.trainer.strategy, TwoDRecStrategy)
    assert cli.trainer.strategy.embedding_optimizer_config.name == "rowwise_adagrad"


def test_two_node_config_resolves_group_size_and_qcomms():
    cli = _build("two_node_2d_fp8.yaml", "--trainer.accelerator", "cpu", "--trainer.devices", "1")
    strategy = cli.trainer.strategy
    assert cli.trainer.num_nodes == 2
    assert strategy.sharding_group_size == 8  # resolved from ${trainer.devices} when the file was read
    assert strategy.effective_qcomms.precisions["pooled_all_to_all"] == ("fp8_e4m3", "bf16")
    assert strategy.replica_sync_config == ReplicaSyncConfig(rows="touched", every_n_steps=1)
    assert strategy.planning == PlanningConfig(planner="torchrec", profile_batches=2)  # grouped configs from YAML
    assert strategy.guard == GuardConfig(validate_inputs="error")


@pytest.mark.parametrize("config", ["movielens_dlrm.yaml", "movielens_dcn.yaml"])
def test_movielens_config_model_matches_the_readers_features(config):
    cli = _build(config, "--data.path", "/nonexistent")
    assert isinstance(cli.datamodule, MovieLens100KDataModule) and cli.datamodule.config.path == "/nonexistent"
    assert cli.model.hparams.feature_names == cli.datamodule.feature_names
    assert cli.model.hparams.table_sizes == cli.datamodule.table_sizes
    assert cli.model.hparams.num_dense_features == cli.datamodule.num_dense_features


def test_criteo_config_model_tables_follow_the_hash_size():
    cli = _build("criteo_dlrm.yaml", "--data.train_paths", "[x.tsv]")
    assert cli.model.hparams.table_sizes == cli.datamodule.table_sizes == [100000] * 26
    assert cli.model.hparams.feature_names == cli.datamodule.feature_names


def test_bad_config_value_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        _build("synthetic_dlrm.yaml", "--trainer.strategy.init_args.layout", "ring")
    assert "layout" in capsys.readouterr().err


def test_a_value_a_config_class_refuses_is_a_usage_error_without_a_traceback(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _build("synthetic_dlrm.yaml", "--trainer.strategy.init_args.replica_sync.every_n_steps", "0")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "ReplicaSyncConfig.every_n_steps=0 must be an integer >= 1" in err and "Traceback" not in err


def test_default_logger_writes_under_default_root_dir(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    cli = _build("synthetic_dlrm.yaml", "--trainer.default_root_dir", str(tmp_path))
    assert isinstance(cli.trainer.logger, CSVLogger)
    assert Path(cli.trainer.logger.save_dir) == tmp_path


def test_a_configured_logger_is_kept(tmp_path):
    cli = _build("synthetic_dlrm.yaml", "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path))
    assert cli.trainer.logger is None


def test_summary_json_outside_fit_is_said_to_be_ignored(tmp_path, monkeypatch):
    """validate/test/predict took --summary-json and wrote nothing, without a word."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_recsys.callbacks import RunSummary

    cli = _build("synthetic_dlrm.yaml", "--summary-json", str(tmp_path / "s.json"), "--trainer.default_root_dir", str(tmp_path))
    cli.subcommand, cli.config_init = "validate", {"validate": cli.config_init}  # as a `validate` run's parse leaves them
    monkeypatch.setattr(LightningCLI, "instantiate_trainer", lambda self, **kwargs: kwargs)  # the Trainer's arguments
    with pytest.warns(UserWarning, match=r"--summary-json .*s\.json is ignored by validate: .* fit only"):
        kwargs = cli.instantiate_trainer()
    assert not any(isinstance(c, RunSummary) for c in kwargs["callbacks"])


def test_help_lists_the_trainer_subcommands_and_plan(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert "{fit,validate,test,predict,plan,prepare}" in usage
    assert "Print the sharding plan report" in usage


def test_plan_defaults_to_the_configs_job_and_planner(capsys):
    assert plan_main(["--config", str(CONFIGS / "synthetic_dlrm.yaml")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("1D sharding over 2 ranks\n")  # trainer.devices: 2, one node
    assert "Sharding plan (TorchRec EmbeddingShardingPlanner): 2 ranks per sharding group, 2 per node, cpu, batch 512 per rank" in printed


def test_plan_prints_the_report_for_a_fit_config(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = plan_main(
        [
            "--config", str(CONFIGS / "synthetic_dlrm.yaml"), "--planner", "balanced",
            "--world-size", "4", "--sharding-group-size", "2", "--profile-batches", "1", "--compare", "--json", str(out),
            "--data.init_args.global_batch_size", "64",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "2D all_to_all_optimized: 2 replicas x sharding groups of 2 ranks" in printed and "max/mean" in printed
    assert "Sharding plan (BalancedPlanner)" in printed and "Sharding plan (TorchRec EmbeddingShardingPlanner)" in printed
    reports = json.loads(out.read_text())
    assert [r["planner"] for r in reports] == ["BalancedPlanner", "TorchRec EmbeddingShardingPlanner"]
    assert [len(r["ranks"]) for r in reports] == [2, 2]
    assert reports[0]["batch_size_per_rank"] == reports[1]["batch_size_per_rank"] == 64 // 4  # rank 0's share of the profiled batch
    assert {t["stats_source"] for r in reports for t in r["tables"]} == {"profiled"}  # both planners saw the profile


def test_plan_reports_planning_errors_with_exit_code_1(capsys):
    code = plan_main(
        [
            "--config", str(CONFIGS / "synthetic_dlrm.yaml"),
            "--world-size", "2", "--profile-batches", "0", "--hash-partitions", "t_sparse_0=3",
        ]
    )  # fmt: skip
    assert code == 1
    assert "hash_partitions['t_sparse_0']=3" in capsys.readouterr().err


def test_plan_cluster_prints_the_cost_models_layout_advice(capsys):
    code = plan_main(["--config", str(CONFIGS / "synthetic_dlrm.yaml"), "--cluster", "8x8@200", "--compute-ms", "5"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Layout advice (cost model) for 8 nodes x 8 GPUs, 200 Gbit/s per node" in printed
    assert "recommended: 1D" in printed or "recommended: 2D" in printed
    assert "projected" in printed and "confidence:" in printed
    assert "compute 20 ms per step assumed" not in printed  # the stated compute time is used


def test_plan_cluster_rejects_a_malformed_value_before_planning(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", str(CONFIGS / "synthetic_dlrm.yaml"), "--cluster", "8-by-8"])
    assert exit_info.value.code == 2
    assert "must look like NODESxGPUS" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, value",
    [
        ("--batch-size", "0"),
        ("--batch-size", "-5"),
        ("--world-size", "0"),
        ("--ranks-per-node", "0"),
        ("--ranks-per-node", "-2"),
        ("--sharding-group-size", "0"),
        ("--memory-per-rank-gib", "0"),
        ("--memory-per-rank-gib", "-1"),
        ("--compute-ms", "0"),
        ("--profile-batches", "-1"),
    ],
)
def test_plan_refuses_a_non_positive_option_before_planning(option, value, capsys):
    # 0 was read as "not given" (the config's value was planned instead, silently) and a negative
    # batch size failed inside TorchRec's estimators with an AssertionError traceback.
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", str(CONFIGS / "synthetic_dlrm.yaml"), option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{option} {value}" in err and "must be" in err


def test_plan_refuses_a_json_path_in_a_missing_directory_before_planning(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_main(["--config", str(CONFIGS / "synthetic_dlrm.yaml"), "--json", str(tmp_path / "nope" / "plan.json")])
    assert exit_info.value.code == 2
    assert "--json" in capsys.readouterr().err

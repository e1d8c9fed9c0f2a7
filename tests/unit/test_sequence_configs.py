"""The two sequence configs: the model's tables follow the DataModule's features (the batch contract)."""

from pathlib import Path

import pytest
import yaml

from lightning_recsys import TwoDRecStrategy
from lightning_recsys.cli import build_cli
from lightning_recsys.data import MovieLens100KSequenceDataModule, SyntheticSequenceDataModule
from lightning_recsys.models.sequence import SequenceRanker

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


@pytest.mark.parametrize(
    ("config", "overrides", "datamodule"),
    [
        ("synthetic_sequence.yaml", [], SyntheticSequenceDataModule),
        ("movielens_sequence.yaml", ["--data.path", "/nonexistent"], MovieLens100KSequenceDataModule),
    ],
)
def test_sequence_config_model_matches_the_datamodule(config, overrides, datamodule):
    cli = build_cli(["--config", str(CONFIGS / config), *overrides], run=False)
    model, data = cli.model, cli.datamodule
    assert isinstance(model, SequenceRanker) and isinstance(data, datamodule) and isinstance(cli.trainer.strategy, TwoDRecStrategy)
    hparams = model.hparams
    assert hparams.item_table_size == data.item_table_size
    assert hparams.num_action_types == data.num_action_types
    assert hparams.context_feature_names == data.context_feature_names
    assert hparams.context_table_sizes == data.context_table_sizes
    assert hparams.num_dense_features == data.num_dense_features
    assert hparams.max_history <= data.max_history_length  # the data may emit more; the model keeps the newest


@pytest.mark.parametrize("config", ["synthetic_sequence.yaml", "movielens_sequence.yaml"])
def test_every_model_and_data_argument_has_a_comment(config):
    text = (CONFIGS / config).read_text()
    parsed = yaml.safe_load(text)
    data = parsed["data"]["init_args"]
    names = [*parsed["model"]["init_args"], *data]
    lines = {line.strip().split(":")[0]: line for line in text.splitlines() if ":" in line}
    # val_batches / test_batches share train_batches' comment
    undocumented = [name for name in names if "#" not in lines[name] and name not in ("val_batches", "test_batches")]
    assert not undocumented, f"{config}: no comment on {undocumented}"

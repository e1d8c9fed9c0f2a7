"""The CLI carries what the data knows (``num_items``, ``max_length``) to the model: written once, checked when written twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_recsys.cli import build_cli
from lightning_recsys.cli.links import DATA_TO_MODEL_LINKS

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


def _build(config: str, *overrides: str):
    return build_cli(["--config", str(CONFIGS / config), *overrides], run=False)


def test_the_pretraining_model_reads_num_items_and_max_length_from_the_data():
    cli = _build("synthetic_pretrain.yaml", "--data.init_args.num_items", "96", "--data.init_args.max_length", "12")
    assert (cli.datamodule.num_items, cli.datamodule.max_length) == (96, 12)
    assert (cli.model.hparams.num_items, cli.model.hparams.max_length) == (96, 12)


def test_a_sequence_file_gives_its_largest_item_id_to_the_model(tmp_path):
    path = tmp_path / "seq.txt"
    path.write_text("".join(f"{user} {item}\n" for user in (1, 2) for item in (3, 7, 5)))
    cli = _build("beauty_pretrain.yaml", "--data.path", str(path), "--data.init_args.num_items", "null")
    assert cli.datamodule.num_items == cli.model.hparams.num_items == 7


def test_a_model_value_that_disagrees_with_the_data_is_an_error_naming_both(capsys):
    with pytest.raises(SystemExit):
        _build("synthetic_pretrain.yaml", "--data.init_args.num_items", "96", "--model.init_args.num_items", "128")
    err = capsys.readouterr().err
    assert "model.init_args.num_items=128 disagrees with the data's num_items=96" in err
    assert "remove it from the model section" in err


def test_a_model_value_equal_to_the_data_is_accepted():
    cli = _build("synthetic_pretrain.yaml", "--data.init_args.num_items", "96", "--model.init_args.num_items", "96")
    assert cli.model.hparams.num_items == 96


def test_models_without_the_arguments_ignore_the_links():
    cli = _build("synthetic_dlrm.yaml")
    assert not any(argument in cli.model.hparams for _, argument in DATA_TO_MODEL_LINKS)


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_no_shipped_config_writes_a_linked_model_argument(config):
    text = (CONFIGS / config).read_text()
    model_section = text.split("\nmodel:", 1)[-1].split("\ndata:", 1)[0]
    for _, argument in DATA_TO_MODEL_LINKS:
        assert f"\n    {argument}:" not in model_section, f"{config} writes model {argument}, which the CLI links from the data"


def test_code_outside_the_cli_gets_the_same_links_and_the_same_check():
    from lightning_recsys.cli.links import linked_model_arguments
    from lightning_recsys.data import SyntheticPretrainDataModule
    from lightning_recsys.models import SequencePretrainer

    data = SyntheticPretrainDataModule(num_items=96, max_length=12)
    assert linked_model_arguments(data, SequencePretrainer, {"embedding_dim": 16}) == {"embedding_dim": 16, "num_items": 96, "max_length": 12, "num_action_types": 0}
    with pytest.raises(ValueError, match="model.init_args.max_length=20 disagrees with the data's max_length=12"):
        linked_model_arguments(data, SequencePretrainer, {"max_length": 20})

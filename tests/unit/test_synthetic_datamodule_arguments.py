"""The synthetic DataModules take their config's fields as typed keyword arguments, as every other DataModule does."""

import dataclasses
import inspect
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningArgumentParser

from lightning_recsys.data import (
    SyntheticClickLogConfig,
    SyntheticClickLogDataModule,
    SyntheticSequenceConfig,
    SyntheticSequenceDataModule,
)

PAIRS = [(SyntheticClickLogDataModule, SyntheticClickLogConfig), (SyntheticSequenceDataModule, SyntheticSequenceConfig)]
IDS = ["click_log", "sequence"]
SMALL_CLICKS = dict(table_sizes=[20, 30], num_dense_features=3, global_batch_size=8, train_batches=2, val_batches=1, seed=4)


def _keyword_parameters(module: type) -> dict[str, inspect.Parameter]:
    params = inspect.signature(module.__init__).parameters.values()
    return {p.name: p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.parametrize(("module", "config_class"), PAIRS, ids=IDS)
def test_keyword_arguments_are_the_config_fields_with_the_same_defaults_and_types(module, config_class):
    params, fields = _keyword_parameters(module), dataclasses.fields(config_class)
    assert list(params) == [f.name for f in fields]
    for f in fields:
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert params[f.name].default == default, f.name
        assert params[f.name].annotation == f.type, f.name  # both are strings (postponed annotations)
    assert module().config == config_class()


def test_keyword_arguments_build_the_validated_config():
    dm = SyntheticClickLogDataModule(**SMALL_CLICKS)
    assert dm.config == SyntheticClickLogConfig(**SMALL_CLICKS)
    assert len(list(dm.train_dataloader())) == 2 and len(list(dm.val_dataloader())) == 1
    sequence = SyntheticSequenceDataModule(num_items=40, num_clusters=4, context_table_sizes=[5], emit_history=False)
    assert sequence.config == SyntheticSequenceConfig(num_items=40, num_clusters=4, context_table_sizes=[5], emit_history=False)
    assert sequence.item_table_size == 40 and sequence.context_table_sizes == [5]


def test_the_default_lists_are_copied_not_shared():
    a, b = SyntheticClickLogDataModule(), SyntheticSequenceDataModule()
    a.config.table_sizes.append(5)
    b.config.context_table_sizes.append(5)
    assert SyntheticClickLogDataModule().config.table_sizes == [1000] * 8
    assert SyntheticSequenceDataModule().config.context_table_sizes == [100, 24]


@pytest.mark.parametrize(("module", "config_class"), PAIRS, ids=IDS)
def test_from_config_takes_a_config_at_hand(module, config_class):
    config = config_class(global_batch_size=16, seed=9)
    assert module.from_config(config).config == config


@pytest.mark.parametrize(("module", "config_class"), PAIRS, ids=IDS)
def test_the_old_config_keyword_is_refused_with_the_new_way(module, config_class):
    name = module.__name__
    with pytest.raises(TypeError, match=rf"{name} no longer takes config=; pass its fields as keyword arguments: {name}\(global_batch_size="):
        module(config=config_class())
    with pytest.raises(TypeError, match=r"in YAML, under data.init_args directly"):
        module(config=None)
    with pytest.raises(TypeError, match=rf"{name}\(\) got an unexpected keyword argument 'global_batch'"):
        module(global_batch=4)


@pytest.mark.parametrize(("module", "config_class"), PAIRS, ids=IDS)
def test_a_positional_config_is_refused_with_the_new_way(module, config_class):
    name = module.__name__
    with pytest.raises(TypeError, match=rf"{name} takes keyword arguments only, got a {config_class.__name__}; .*{name}\.from_config"):
        module(config_class())
    with pytest.raises(TypeError, match=r"takes keyword arguments only, got 1 positional argument\(s\); pass its fields"):
        module([10, 20])


def _parser() -> LightningArgumentParser:
    from lightning.pytorch import LightningDataModule

    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningDataModule, "data")
    return parser


def test_a_cli_config_writes_the_fields_under_init_args():
    parser = _parser()
    data = {"class_path": "lightning_recsys.data.SyntheticClickLogDataModule", "init_args": {"global_batch_size": 64, "table_sizes": [5, 6]}}
    parsed = parser.parse_object({"data": data})
    dm = parser.instantiate(parsed).data
    assert isinstance(dm, SyntheticClickLogDataModule)
    assert dm.config.global_batch_size == 64 and dm.config.table_sizes == [5, 6] and dm.config.train_batches == 200
    old = {"class_path": "lightning_recsys.data.SyntheticSequenceDataModule", "init_args": {"config": {"num_items": 80}}}
    with pytest.raises(Exception, match=r"config"):
        parser.parse_object({"data": old})


def test_the_shipped_configs_no_longer_nest_a_config_under_data():
    configs = Path(__file__).resolve().parents[2] / "examples" / "configs"
    for path in configs.glob("*.yaml"):
        text = path.read_text()
        assert "init_args.config." not in text and "\n    config:" not in text, path.name


def test_the_cli_links_read_the_sequence_module_built_from_keywords():
    from lightning_recsys.cli.links import linked_model_arguments
    from lightning_recsys.models import SequenceRanker

    data = SyntheticSequenceDataModule(num_items=64, num_clusters=4, num_action_types=4)
    linked = linked_model_arguments(data, SequenceRanker, {"embedding_dim": 8})
    assert linked["item_table_size"] == 64 and linked["num_action_types"] == 4
    with pytest.raises(ValueError, match=r"item_table_size=65 disagrees with the data's item_table_size=64"):
        linked_model_arguments(data, SequenceRanker, {"item_table_size": 65})

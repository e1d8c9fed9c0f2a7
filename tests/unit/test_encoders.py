"""Encoders as modules: the protocol, how a model takes one (class, partial, config mapping, LightningCLI), old names."""

from __future__ import annotations

import io
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_recsys.contracts import ITEM_TABLE
from lightning_recsys.contracts.encoder import SequenceEncoder, check_encoder
from lightning_recsys.models import SequencePretrainer, SequenceRanker
from lightning_recsys.models.encoders import ENCODERS, SASRecEncoder, TransActEncoder, resolve_encoder

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_every_shipped_encoder_implements_the_protocol(name):
    encoder = ENCODERS[name](12, 5)
    assert isinstance(encoder, SequenceEncoder) and isinstance(encoder, nn.Module)
    assert (encoder.embedding_dim, encoder.max_length) == (12, 5)
    tokens = torch.randn(3, 5, encoder.token_dim)
    valid = torch.tensor([[True] * 5, [True, True, False, False, False], [False] * 5])
    if not encoder.causal:  # newest last: padding on the left
        valid = valid.flip(1)
    out = encoder.eval()(tokens, valid)
    assert out.shape == (3, 5, encoder.token_dim) and torch.isfinite(out).all()
    assert encoder.token_dim == (12 if encoder.causal else 36)


def test_check_encoder_names_what_differs():
    with pytest.raises(TypeError, match=r"built a int, not an nn.Module"):
        check_encoder(3, embedding_dim=8, max_length=4, owner="M")
    with pytest.raises(TypeError, match=r"lacks \['embedding_dim', 'max_length', 'token_dim', 'causal'\]"):
        check_encoder(nn.Linear(2, 2), embedding_dim=8, max_length=4, owner="M")
    with pytest.raises(ValueError, match=r"with max_length=5, but the model called it with max_length=4"):
        check_encoder(SASRecEncoder(8, 5), embedding_dim=8, max_length=4, owner="M")


def test_a_model_takes_a_class_a_partial_a_mapping_or_any_factory():
    for encoder in (
        partial(SASRecEncoder, num_layers=1),
        {"class_path": "lightning_recsys.models.encoders.SASRecEncoder", "init_args": {"num_layers": 1}},
        lambda dim, length: SASRecEncoder(dim, length, num_layers=1),
    ):
        model = SequencePretrainer(num_items=20, embedding_dim=8, max_length=4, encoder=encoder)
        assert isinstance(model.encoder, SASRecEncoder) and len(model.encoder.blocks) == 1
    model = SequencePretrainer(num_items=20, embedding_dim=8, max_length=4, encoder=SASRecEncoder)
    assert len(model.encoder.blocks) == 2
    with pytest.raises(ValueError, match=r"no class there"):
        resolve_encoder({"class_path": "lightning_recsys.models.encoders.NoSuchEncoder"}, SASRecEncoder, "M")
    with pytest.raises(ValueError, match=r"must be an encoder class, a factory"):
        resolve_encoder(3, SASRecEncoder, "M")


def test_hyperparameters_record_the_encoder_as_plain_data_and_rebuild_it():
    model = SequencePretrainer(num_items=20, embedding_dim=8, max_length=4, encoder=partial(SASRecEncoder, num_layers=1, num_heads=2))
    record = model.hparams["encoder"]
    assert record == {"class_path": "lightning_recsys.models.encoders.SASRecEncoder", "init_args": {"num_layers": 1, "num_heads": 2}}
    buffer = io.BytesIO()
    torch.save(dict(model.hparams), buffer)
    buffer.seek(0)
    again = SequencePretrainer(**torch.load(buffer, weights_only=True))  # a checkpoint's hyperparameters, read safely
    assert len(again.encoder.blocks) == 1 and again.encoder.blocks[0].attention.num_heads == 2


def test_the_defaults_are_todays_encoders_and_the_shorthand_reaches_them():
    pretrainer = SequencePretrainer(num_items=20, embedding_dim=8, max_length=4)
    encoder = pretrainer.encoder
    assert isinstance(encoder, SASRecEncoder) and len(encoder.blocks) == 2
    assert encoder.blocks[0].attention.num_heads == 1 and encoder.blocks[0].feedforward[0].out_features == 8
    assert encoder.embedding_dropout.p == 0.1 and pretrainer.hparams["encoder"] is None
    short = SequencePretrainer(num_items=20, embedding_dim=8, max_length=4, num_layers=1, num_heads=2, feedforward_dim=6, dropout=0.0)
    assert len(short.encoder.blocks) == 1 and short.encoder.blocks[0].feedforward[0].out_features == 6
    ranker = SequenceRanker(item_table_size=20, num_action_types=2, embedding_dim=8, max_history=12)
    assert isinstance(ranker.encoder, TransActEncoder) and ranker.encoder.num_layers == 2
    assert ranker.encoder.layers[0].self_attn.num_heads == 2 and ranker.encoder.layers[0].linear1.out_features == 4 * 24
    with pytest.raises(ValueError, match=r"dropout=0.2 set the default encoder's options, but encoder= names the encoder"):
        SequencePretrainer(num_items=20, embedding_dim=8, max_length=4, encoder=SASRecEncoder, dropout=0.2)


def test_the_pretrainer_refuses_an_encoder_that_is_not_causal():
    with pytest.raises(ValueError, match=r"next-item pretraining needs a causal encoder"):
        SequencePretrainer(num_items=20, embedding_dim=8, max_length=4, encoder=TransActEncoder)


def test_the_ranker_learns_the_layout_from_a_factory_that_names_no_class():
    ranker = SequenceRanker(item_table_size=20, num_action_types=0, embedding_dim=8, max_history=4,
                            encoder=lambda dim, length: SASRecEncoder(dim, length, num_heads=2))  # fmt: skip
    assert ranker.causal_encoder and set(ranker.item_embeddings.embeddings) == {ITEM_TABLE}


def test_old_import_paths_name_the_same_objects():
    from lightning_recsys.contracts import names
    from lightning_recsys.contracts.length_rules import FeatureLengthRules
    from lightning_recsys.contracts.ranking import ItemRanking
    from lightning_recsys.models import pretrainer, sequence
    from lightning_recsys.parallel.input import FeatureLengthRules as OldRules
    from lightning_recsys.parallel.ranking import ItemRanking as OldRanking
    from lightning_recsys.parallel.ranking import UnshardedItemRanking as OldUnsharded
    from lightning_recsys.ranking import UnshardedItemRanking

    assert pretrainer.SASRecEncoder is SASRecEncoder and pretrainer.ITEM_TABLE == names.ITEM_TABLE
    assert pretrainer.ITEM_FEATURE is names.ITEM_FEATURE and pretrainer.NEGATIVE_FEATURE is names.NEGATIVE_FEATURE
    assert sequence.ITEM_TABLE is names.ITEM_TABLE and sequence.ACTION_TABLE is names.ACTION_TABLE
    assert OldRules is FeatureLengthRules and OldRanking is ItemRanking and OldUnsharded is UnshardedItemRanking


def test_lightning_cli_instantiates_an_encoder_named_by_class_path():
    from lightning_recsys.cli import build_cli

    cli = build_cli([
        "--config", str(CONFIGS / "synthetic_pretrain.yaml"), "--trainer.devices", "1",
        "--model.init_args.encoder", "lightning_recsys.models.encoders.SASRecEncoder",
        "--model.init_args.encoder.init_args.num_layers", "1", "--model.init_args.encoder.init_args.dropout", "0.2",
    ], run=False)  # fmt: skip
    assert isinstance(cli.model.encoder, SASRecEncoder) and len(cli.model.encoder.blocks) == 1
    assert cli.model.encoder.embedding_dropout.p == 0.2
    assert cli.model.hparams["encoder"]["class_path"] == "lightning_recsys.models.encoders.SASRecEncoder"


def test_the_strategy_hands_models_its_ranking_through_the_contract():
    from lightning_recsys.contracts.ranking import ItemRankingProvider
    from lightning_recsys.strategies import TwoDRecStrategy

    assert issubclass(TwoDRecStrategy, ItemRankingProvider)

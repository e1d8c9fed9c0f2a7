"""Warm start on one process: picking and renaming keys, the checks before any read, the SASRec ranker's shared encoder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec import KeyedJaggedTensor

from lightning_recsys.callbacks import InitFromCheckpoint
from lightning_recsys.checkpoint import CheckpointMismatchError, export_safetensors
from lightning_recsys.checkpoint.warm_start import load_weights_unsharded, select_weights
from lightning_recsys.data import RecBatch
from lightning_recsys.models import SequencePretrainer, SequenceRanker
from tests.crafted_checkpoints import write_checkpoint
from tests.pretrain_oracle import make_batch

ITEMS, DIM, LENGTH = 40, 8, 6
ENCODER = dict(embedding_dim=DIM, num_layers=2, num_heads=2, dropout=0.0)


def pretrainer(seed: int = 0, **overrides: object) -> SequencePretrainer:
    torch.manual_seed(seed)
    return SequencePretrainer(**{"num_items": ITEMS, "num_action_types": 3, "max_length": LENGTH, **ENCODER, **overrides})  # type: ignore[arg-type]


def ranker(seed: int = 1, **overrides: object) -> SequenceRanker:
    torch.manual_seed(seed)
    arguments = dict(
        item_table_size=ITEMS, num_action_types=3, context_feature_names=["user_id"], context_table_sizes=[5], num_dense_features=2,
        max_history=LENGTH, sequence_encoder="sasrec", over_arch_layer_sizes=[8, 1], **ENCODER,
    )
    return SequenceRanker(**{**arguments, **overrides})  # type: ignore[arg-type]


def ranker_batch(histories: list[list[int]], candidates: list[int], with_actions: bool = True) -> RecBatch:
    actions = [[item % 3 for item in history] for history in histories]
    columns = [histories] + ([actions] if with_actions else []) + [[[c] for c in candidates], [[i % 5] for i in range(len(histories))]]
    keys = ["history_item_id"] + (["history_action"] if with_actions else []) + ["candidate_item_id", "user_id"]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.tensor([v for column in columns for example in column for v in example], dtype=torch.long),
        lengths=torch.tensor([len(example) for column in columns for example in column]),
    )
    return RecBatch(torch.randn(len(histories), 2), kjt, torch.ones(len(histories)))


def test_select_weights_picks_renames_and_refuses_what_does_not_fit():
    source = ["encoder.positions", "encoder.blocks.0.attention.in_proj_weight", "item_embeddings.embeddings.item.weight"]
    target = {"encoder.positions", "encoder.blocks.0.attention.in_proj_weight", "sequence_embeddings.embeddings.item.weight", "over_arch.0.weight"}
    assert select_weights(source, target, include=["encoder.*"]) == {k: k for k in source[:2]}
    renamed = select_weights(source, target, rename={"item_embeddings.": "sequence_embeddings."})
    assert renamed["sequence_embeddings.embeddings.item.weight"] == "item_embeddings.embeddings.item.weight" and len(renamed) == 3
    with pytest.raises(ValueError, match=r"include pattern\(s\) \['decoder\.\*'\] match no tensor"):
        select_weights(source, target, include=["encoder.*", "decoder.*"])
    with pytest.raises(ValueError, match=r"no tensor for 1 checkpoint key.*item_embeddings\.embeddings\.item\.weight"):
        select_weights(source, target)
    with pytest.raises(ValueError, match="maps both"):
        select_weights(source, target | {"x.positions"}, include=["encoder.positions", "item_embeddings.*"],
                       rename={"encoder.": "x.", "item_embeddings.embeddings.item.weight": "x.positions"})


def test_sasrec_ranker_has_the_pretrainers_names_and_reads_the_candidate_after_the_history():
    source, target = pretrainer(), ranker()
    shared = {k: v for k, v in source.state_dict().items()}
    assert set(shared) <= set(target.state_dict()), set(shared) - set(target.state_dict())
    target.load_state_dict(shared, strict=False)
    target.eval()
    source.eval()
    histories, candidates = [[3, 7, 9], [], [1, 2, 3, 4, 5, 6, 7, 8]], [11, 12, 13]
    seen: list[torch.Tensor] = []
    target.over_arch.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    target(ranker_batch(histories, candidates))
    # The pretrainer's encoder over history + [candidate], the candidate's token without an action row (the ranker's
    # candidate has no action); the pretrainer's own forward (with action 0 on the candidate) differs from it.
    newest = [h[-(LENGTH - 1):] + [c] for h, c in zip(histories, candidates)]
    actions = [[i % 3 for i in h[-(LENGTH - 1):]] for h in histories]
    hidden, _, _ = source._encode(make_batch(newest, actions=[a + [0] for a in actions]))
    for example, tokens in enumerate(newest):
        alone = source.encoder(*_tokens_without_candidate_action(source, tokens, actions[example]))
        torch.testing.assert_close(seen[0][example, :DIM], alone[0, len(tokens) - 1])
        assert not torch.allclose(hidden[example, len(tokens) - 1], alone[0, len(tokens) - 1])  # the action row mattered
    candidate_rows = source.item_embeddings.embeddings["item"].weight[candidates]
    torch.testing.assert_close(seen[0][:, DIM : 2 * DIM], candidate_rows.detach())


def _tokens_without_candidate_action(source: SequencePretrainer, items: list[int], actions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    tables = source.item_embeddings.embeddings
    rows = tables["item"].weight[items].detach().clone()
    rows[: len(actions)] += tables["action"].weight[actions].detach()
    tokens = torch.zeros(1, LENGTH, DIM)
    tokens[0, : len(items)] = rows
    valid = torch.zeros(1, LENGTH, dtype=torch.bool)
    valid[0, : len(items)] = True
    return tokens, valid


def test_sasrec_ranker_without_actions_and_its_refused_options():
    model = ranker(num_action_types=0)
    assert set(model.item_embeddings.embeddings) == {"item"}
    logits = model(ranker_batch([[1, 2], []], [3, 4], with_actions=False))
    assert logits.shape == (2,) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"newest_tokens=2, action_means=True: TransAct encoder option"):
        ranker(newest_tokens=2, action_means=True)
    with pytest.raises(ValueError, match=r"num_action_types=0 must be an integer >= 1"):
        SequenceRanker(item_table_size=ITEMS, num_action_types=0)
    with pytest.raises(ValueError, match=r"sequence_encoder='bert' is not one of"):
        ranker(sequence_encoder="bert")


def test_sasrec_ranker_trains_end_to_end():
    model = ranker()
    batch = ranker_batch([[1, 2, 3], [4], []], [5, 6, 7])
    loss = model.training_losses(batch)["loss"]
    loss.backward()
    assert model.encoder.positions.grad is not None and model.item_embeddings.embeddings["item"].weight.grad is not None


def test_init_from_checkpoint_arguments_are_checked():
    with pytest.raises(ValueError, match=r"include='encoder\.\*'\) must be a non-empty list"):
        InitFromCheckpoint("ckpt", include="encoder.*")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rename=\{'': 'x'\}\) must map"):
        InitFromCheckpoint("ckpt", rename={"": "x"})
    with pytest.raises(ValueError, match=r"path=''\) must be"):
        InitFromCheckpoint("")


@pytest.mark.parametrize("form", ["dcp", "safetensors"])
def test_warm_start_equals_loading_the_same_weights_by_hand(tmp_path, form):
    source = pretrainer()
    checkpoint = write_checkpoint(source, tmp_path / "pretrain.ckpt", host_state={})
    path = export_safetensors(checkpoint, tmp_path / "pretrain.safetensors") if form == "safetensors" else checkpoint
    warm, by_hand = ranker(seed=5), ranker(seed=5)
    result = load_weights_unsharded(path, warm, include=["encoder.*", "item_embeddings.*"])
    by_hand.load_state_dict(source.state_dict(), strict=False)
    assert set(result.loaded) == set(source.state_dict()) and all(k == v for k, v in result.loaded.items())
    for key, value in by_hand.state_dict().items():
        torch.testing.assert_close(warm.state_dict()[key], value, rtol=0, atol=0, msg=key)
    untouched = ranker(seed=5)
    torch.testing.assert_close(warm.over_arch[0].weight, untouched.over_arch[0].weight, rtol=0, atol=0)


def test_warm_start_names_every_mismatch_with_both_shapes_and_reads_nothing(tmp_path):
    checkpoint = write_checkpoint(pretrainer(), tmp_path / "pretrain.ckpt", host_state={})
    target = ranker(item_table_size=ITEMS + 2, max_history=LENGTH + 1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as error:
        load_weights_unsharded(checkpoint, target)
    message = str(error.value)
    assert "table 'item' 'item_embeddings.embeddings.item.weight': the checkpoint has shape (40, 8), the model has (42, 8)" in message
    assert "parameter 'encoder.positions': the checkpoint has shape (6, 8), the model has (7, 8)" in message
    assert "2 picked tensor(s)" in message
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key]), key
    with pytest.raises(ValueError, match=r"include pattern\(s\) \['over_arch\.\*'\] match no tensor"):
        load_weights_unsharded(checkpoint, ranker(), include=["over_arch.*"])


def test_the_cli_form_parses_into_the_callback(tmp_path):
    from lightning_recsys.cli import build_cli

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "synthetic_sequence.yaml"
    cli = build_cli([
        "--config", str(config), "--model.init_args.sequence_encoder", "sasrec", "--model.init_args.newest_tokens", "null",
        "--model.init_args.action_loss_weight", "0", "--model.init_args.positive_actions", "null", "--model.init_args.embedding_dim", "8",
        "--trainer.callbacks+=lightning_recsys.callbacks.InitFromCheckpoint", "--trainer.callbacks.path", str(tmp_path / "last.ckpt"),
        "--trainer.callbacks.include", "[encoder.*]",
    ], run=False)  # fmt: skip
    (warm,) = [c for c in cli.trainer.callbacks if isinstance(c, InitFromCheckpoint)]
    assert warm.path == str(tmp_path / "last.ckpt") and warm.include == ["encoder.*"] and warm.rename is None
    assert cli.model.sequence_encoder == "sasrec"


def test_callback_under_a_plain_trainer_loads_once_and_a_later_fit_keeps_what_it_trained(tmp_path, caplog):
    from lightning.pytorch import Callback, Trainer

    checkpoint = write_checkpoint(pretrainer(), tmp_path / "pretrain.ckpt", host_state={})
    source = pretrainer().state_dict()

    class Seen(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.positions = pl_module.encoder.positions.detach().clone()

    model, warm, seen = ranker(), InitFromCheckpoint(str(checkpoint)), Seen()
    batches = torch.utils.data.DataLoader([ranker_batch([[1, 2, 3], [4], []], [5, 6, 7])], batch_size=None)

    def fit() -> None:
        trainer = Trainer(
            accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[warm, seen],
        )
        trainer.fit(model, train_dataloaders=batches)

    with caplog.at_level("INFO"):
        fit()
    assert torch.equal(seen.positions, source["encoder.positions"]) and warm.result is not None
    assert set(warm.result.loaded) == set(source)
    trained = model.encoder.positions.detach().clone()
    assert not torch.equal(trained, source["encoder.positions"])
    with caplog.at_level("INFO"):
        fit()
    assert torch.equal(seen.positions, trained) and warm.result is None
    assert "an earlier fit already loaded it into this model" in caplog.text

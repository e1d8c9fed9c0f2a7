"""Warm start on one process: picking and renaming keys, by role, the checks before any read, the SASRec ranker's shared encoder."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torchrec import KeyedJaggedTensor

from lightning_recsys.callbacks import InitFromCheckpoint
from lightning_recsys.checkpoint import CheckpointMismatchError, export_safetensors
from lightning_recsys.checkpoint.warm_start import load_weights_unsharded, select_weights
from lightning_recsys.contracts.warm_start import WARM_START_PARTS_KEY, WarmStartPart, parts_record
from lightning_recsys.data import RecBatch
from lightning_recsys.models import SequencePretrainer, SequenceRanker
from lightning_recsys.models.encoders import SASRecEncoder, TransActEncoder
from lightning_recsys.testing.crafted_checkpoints import write_checkpoint
from lightning_recsys.testing.oracle.pretrain import make_batch

ITEMS, DIM, LENGTH = 40, 8, 6
ENCODER = dict(embedding_dim=DIM, num_layers=2, num_heads=2, dropout=0.0)
SASREC = partial(SASRecEncoder, num_layers=2, num_heads=2, dropout=0.0)


def pretrainer(seed: int = 0, **overrides: object) -> SequencePretrainer:
    torch.manual_seed(seed)
    return SequencePretrainer(**{"num_items": ITEMS, "num_action_types": 3, "max_length": LENGTH, **ENCODER, **overrides})  # type: ignore[arg-type]


def ranker(seed: int = 1, **overrides: object) -> SequenceRanker:
    torch.manual_seed(seed)
    arguments = dict(
        item_table_size=ITEMS, num_action_types=3, context_feature_names=["user_id"], context_table_sizes=[5], num_dense_features=2,
        max_history=LENGTH, encoder=SASREC, over_arch_layer_sizes=[8, 1], embedding_dim=DIM,
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
    with pytest.raises(ValueError, match=r"newest_tokens=2, action_means=True: option\(s\) of the TransAct-style ranker"):
        ranker(newest_tokens=2, action_means=True)
    with pytest.raises(ValueError, match=r"num_action_types=0 must be an integer >= 1"):
        SequenceRanker(item_table_size=ITEMS, num_action_types=0)
    # The removed string choice names the class_path to write instead.
    with pytest.raises(ValueError, match=r"sequence_encoder='sasrec'\) was replaced by encoder=.*models\.encoders\.SASRecEncoder"):
        ranker(sequence_encoder="sasrec")
    with pytest.raises(ValueError, match=r"num_layers=2 set the default encoder's options, but encoder= names the encoder"):
        ranker(num_layers=2)


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
    assert "2 picked tensor(s)" in message and "part" not in message  # picked by key: no roles named
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key]), key
    with pytest.raises(ValueError, match=r"include pattern\(s\) \['over_arch\.\*'\] match no tensor"):
        load_weights_unsharded(checkpoint, ranker(), include=["over_arch.*"])


def test_the_cli_form_parses_into_the_callback(tmp_path):
    from lightning_recsys.cli import build_cli

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "synthetic_sequence.yaml"
    cli = build_cli([
        "--config", str(config), "--model.init_args.encoder", "lightning_recsys.models.encoders.SASRecEncoder",
        "--model.init_args.encoder.init_args.num_layers", "1", "--model.init_args.newest_tokens", "null",
        "--model.init_args.action_loss_weight", "0", "--model.init_args.positive_actions", "null", "--model.init_args.embedding_dim", "8",
        "--trainer.callbacks+=lightning_recsys.callbacks.InitFromCheckpoint", "--trainer.callbacks.path", str(tmp_path / "last.ckpt"),
        "--trainer.callbacks.include", "[encoder.*]",
    ], run=False)  # fmt: skip
    (warm,) = [c for c in cli.trainer.callbacks if isinstance(c, InitFromCheckpoint)]
    assert warm.path == str(tmp_path / "last.ckpt") and warm.include == ["encoder.*"] and warm.rename is None
    assert isinstance(cli.model.encoder, SASRecEncoder) and len(cli.model.encoder.blocks) == 1 and cli.model.causal_encoder


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


def _with_parts(model: object, tmp_path: Path, name: str = "pretrain.ckpt", **replace: WarmStartPart) -> Path:
    """A checkpoint of ``model`` whose host state records its parts (as ``RecsysModule.on_save_checkpoint`` does)."""
    parts = {**model.warm_start_parts(), **replace}  # type: ignore[attr-defined]
    return write_checkpoint(model, tmp_path / name, host_state={WARM_START_PARTS_KEY: parts_record(parts)})  # type: ignore[arg-type]


def test_a_model_records_its_parts_in_every_checkpoint_it_saves():
    checkpoint: dict = {}
    pretrainer().on_save_checkpoint(checkpoint)
    assert checkpoint[WARM_START_PARTS_KEY] == {
        "encoder": {"prefix": "encoder.", "kind": "lightning_recsys.models.encoders.SASRecEncoder"},
        "item_table": {"prefix": "item_embeddings.embeddings.item.", "kind": "table"},
    }
    assert ranker(encoder=TransActEncoder, newest_tokens=2).warm_start_parts()["item_table"].prefix == "sequence_embeddings.embeddings.item."


def test_parts_load_by_role_wherever_each_model_holds_them(tmp_path):
    source = pretrainer()
    checkpoint = _with_parts(source, tmp_path)
    warm = ranker(seed=5)
    result = load_weights_unsharded(checkpoint, warm, parts={r: p for r, p in warm.warm_start_parts().items()})
    assert set(result.loaded) == {k for k in source.state_dict() if k.startswith(("encoder.", "item_embeddings.embeddings.item."))}
    for key, value in source.state_dict().items():
        if key in result.loaded:
            torch.testing.assert_close(warm.state_dict()[key], value, rtol=0, atol=0, msg=key)
    assert not torch.equal(warm.item_embeddings.embeddings["action"].weight, source.item_embeddings.embeddings["action"].weight)
    # The TransAct ranker holds its item table under another attribute: the role finds it there.
    transact = ranker(seed=6, encoder=TransActEncoder, newest_tokens=2)
    loaded = load_weights_unsharded(checkpoint, transact, parts={"item_table": transact.warm_start_parts()["item_table"]}).loaded
    assert loaded == {"sequence_embeddings.embeddings.item.weight": "item_embeddings.embeddings.item.weight"}
    torch.testing.assert_close(transact.sequence_embeddings.embeddings["item"].weight, source.item_embeddings.embeddings["item"].weight)
    # A checkpoint that records its parts elsewhere (another attribute name) is read where it says.
    moved = _with_parts(source, tmp_path, "moved.ckpt", item_table=WarmStartPart("item_embeddings.embeddings.item.", "table"))
    assert load_weights_unsharded(moved, ranker(seed=7), parts={"item_table": warm.warm_start_parts()["item_table"]}).loaded


def test_parts_that_do_not_fit_say_which_and_how(tmp_path):
    checkpoint = _with_parts(pretrainer(), tmp_path)
    transact = ranker(encoder=TransActEncoder, newest_tokens=2)
    with pytest.raises(CheckpointMismatchError, match=r"'encoder' part differs in kind: the checkpoint's is "
                       r"lightning_recsys\.models\.encoders\.SASRecEncoder, the model's is .*TransActEncoder"):
        load_weights_unsharded(checkpoint, transact, parts={"encoder": transact.warm_start_parts()["encoder"]})
    shallow = ranker(encoder=partial(SASRecEncoder, num_layers=3, num_heads=2, dropout=0.0))
    with pytest.raises(CheckpointMismatchError, match=r"'encoder' part holds other tensors: the checkpoint lacks \['encoder\.blocks\.2\."):
        load_weights_unsharded(checkpoint, shallow, parts={"encoder": shallow.warm_start_parts()["encoder"]})
    wider = ranker(item_table_size=ITEMS + 1)
    with pytest.raises(CheckpointMismatchError, match=r"the 'item_table' part's table 'item' .*\(40, 8\), the model has \(41, 8\)"):
        load_weights_unsharded(checkpoint, wider, parts=dict(wider.warm_start_parts()))
    no_encoder = write_checkpoint(pretrainer(), tmp_path / "tables.ckpt", host_state={
        WARM_START_PARTS_KEY: {"item_table": {"prefix": "item_embeddings.embeddings.item.", "kind": "table"}}})
    with pytest.raises(ValueError, match=r"the checkpoint has no 'encoder' part; its model recorded \['item_table'\]"):
        load_weights_unsharded(no_encoder, ranker(), parts=dict(ranker().warm_start_parts()))


def test_init_from_checkpoint_parts_are_checked_against_the_model():
    with pytest.raises(ValueError, match=r"parts=\['encoder'\]\) picks by role; include=\['x\.\*'\]"):
        InitFromCheckpoint("ckpt", parts=["encoder"], include=["x.*"])
    with pytest.raises(ValueError, match=r"parts=\[\]\) must be a non-empty list"):
        InitFromCheckpoint("ckpt", parts=[])
    warm = InitFromCheckpoint("ckpt", parts=["encoder", "user_tower"])
    with pytest.raises(ValueError, match=r"SequenceRanker has no \['user_tower'\] part; it has \['encoder', 'item_table'\]"):
        warm._model_parts(ranker())


def test_a_safetensors_export_records_no_parts_so_each_is_looked_for_where_the_model_holds_it(tmp_path):
    source = pretrainer()
    exported = export_safetensors(_with_parts(source, tmp_path), tmp_path / "pretrain.safetensors")
    warm = ranker(seed=5)
    loaded = load_weights_unsharded(exported, warm, parts=dict(warm.warm_start_parts())).loaded
    assert set(loaded) == {k for k in source.state_dict() if k.startswith(("encoder.", "item_embeddings.embeddings.item."))}
    transact = ranker(encoder=TransActEncoder, newest_tokens=2)
    with pytest.raises(ValueError, match=r"no tensor of the 'item_table' part under 'sequence_embeddings\.embeddings\.item\.' "
                       r"\(the checkpoint records no parts: looked where the model holds it\)"):  # fmt: skip
        load_weights_unsharded(exported, transact, parts={"item_table": transact.warm_start_parts()["item_table"]})

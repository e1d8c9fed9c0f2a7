"""CheckpointMismatchError's "How to fix" fits the mismatches it lists (not always the table-size hint)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

from lightning_recsys.checkpoint import CheckpointMismatchError
from lightning_recsys.checkpoint.table_state import ROWWISE_MOMENTUM, state_key
from lightning_recsys.checkpoint.validation import ExpectedEntry, check_entries

T0 = "ebc.embedding_bags.t0.weight"


def _entries() -> list[ExpectedEntry]:
    return [
        ExpectedEntry(key=f"model.{T0}", shapes=((5, 4),), table=T0),
        ExpectedEntry(key="model.over.weight", shapes=((1, 8),)),
        ExpectedEntry(key=state_key(T0, ROWWISE_MOMENTUM), shapes=((5,), (5, 4)), table=T0),
    ]


GOOD = {f"model.{T0}": (5, 4), "model.over.weight": (1, 8), state_key(T0, ROWWISE_MOMENTUM): (5,)}


def _message(saved: dict[str, tuple[int, ...]], *, strict: bool = True, saved_optimizer: str = "rowwise_adagrad") -> str:
    metadata = Metadata(
        state_dict_metadata={
            k: TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(s), chunks=[])
            for k, s in saved.items()
        }
    )
    with pytest.raises(CheckpointMismatchError) as info:
        check_entries(_entries(), metadata, path=Path("/ckpt"), strict=strict,
                      optimizer_name="rowwise_adagrad", saved_optimizer={"name": saved_optimizer})
    return str(info.value)


def _fix(message: str) -> str:
    assert message.count("How to fix:") == 1, message
    return message.split("How to fix:", 1)[1]


def test_a_resized_table_gets_the_table_size_advice() -> None:
    fix = _fix(_message({**GOOD, f"model.{T0}": (6, 4), state_key(T0, ROWWISE_MOMENTUM): (6,)}))
    assert "num_embeddings" in fix and "embedding_dim" in fix and "strict=False does not skip" in fix


def test_a_resized_dense_layer_names_the_layer_sizes_not_the_tables() -> None:
    fix = _fix(_message({**GOOD, "model.over.weight": (2, 8)}))
    assert "num_embeddings" not in fix and "EmbeddingBagConfig" not in fix
    assert "layer" in fix and "strict=False does not skip" in fix


def test_a_missing_or_extra_dense_key_suggests_strict_false_not_table_sizes() -> None:
    fix = _fix(_message({k: v for k, v in GOOD.items() if k != "model.over.weight"} | {"model.extra.bias": (3,)}))
    assert "num_embeddings" not in fix and "resized" not in fix
    assert "strict=False" in fix and "does not skip" not in fix


def test_a_renamed_table_gets_the_table_name_advice_not_the_size_advice() -> None:
    saved = {k.replace(".t0.", ".t0_old."): v for k, v in GOOD.items()}
    fix = _fix(_message(saved))
    assert "EmbeddingBagConfig name" in fix and "strict=False" in fix
    assert "num_embeddings" not in fix


def test_another_embedding_optimizer_gets_only_the_optimizer_advice_once() -> None:
    saved = {k: v for k, v in GOOD.items() if "embedding_optimizer" not in k} | {state_key(T0, "momentum1"): (5, 4)}
    message = _message(saved, saved_optimizer="adagrad")
    fix = _fix(message)
    assert "EmbeddingOptimizerConfig(name='adagrad')" in fix and "load_embedding_optimizer_state=False" in fix
    # strict=False reports a missing optimizer state all the same, and no table was resized.
    assert "num_embeddings" not in fix and "pass strict=False" not in fix
    assert message.count("load_embedding_optimizer_state=False") == 1


def test_missing_optimizer_state_of_the_same_optimizer_does_not_suggest_switching_optimizers() -> None:
    fix = _fix(_message({k: v for k, v in GOOD.items() if "embedding_optimizer" not in k}))
    assert "load_embedding_optimizer_state=False" in fix and "EmbeddingOptimizerConfig(name=" not in fix


def test_several_kinds_of_mismatch_get_each_advice() -> None:
    saved = {**GOOD, f"model.{T0}": (6, 4), state_key(T0, ROWWISE_MOMENTUM): (6,), "model.over.weight": (2, 8)}
    fix = _fix(_message(saved))
    assert "num_embeddings" in fix and "layer" in fix


# --------------------------------------------------------------------------- under a Trainer (DCPCheckpointIO)
STRICT_LOADING_ADVICE = "strict=False is the LightningModule's `strict_loading = False`"


def _trainer_message(monkeypatch, saved: dict[str, tuple[int, ...]], saved_optimizer: str = "rowwise_adagrad") -> str:
    """The error DCPCheckpointIO.load_checkpoint raises for this mismatch (the Trainer's remedies appended)."""
    from types import SimpleNamespace

    from lightning_recsys.strategies import checkpoint_io

    def mismatch(path, **kwargs):
        metadata = Metadata(state_dict_metadata={
            k: TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(s), chunks=[])
            for k, s in saved.items()
        })
        check_entries(_entries(), metadata, path=Path(path), strict=kwargs["strict"], optimizer_name="rowwise_adagrad",
                      saved_optimizer={"name": saved_optimizer})
        raise AssertionError("no mismatch")

    monkeypatch.setattr(checkpoint_io, "load_checkpoint", mismatch)
    monkeypatch.setattr(checkpoint_io, "read_meta", lambda path: SimpleNamespace(embedding_optimizer={"name": saved_optimizer}))
    source = SimpleNamespace(
        topology=None, load_strictly=lambda: True, restores_optimizer_state=lambda: True,
        sharded_checkpoint_state=lambda: SimpleNamespace(embedding_optimizer=SimpleNamespace(name="rowwise_adagrad")),
    )
    io = checkpoint_io.DCPCheckpointIO()
    io.connect(source)  # type: ignore[arg-type]
    with pytest.raises(CheckpointMismatchError) as info:
        io.load_checkpoint("/ckpt")
    return str(info.value)


def test_under_a_trainer_missing_optimizer_state_does_not_suggest_strict_loading(monkeypatch) -> None:
    """strict_loading = False does not skip embedding optimizer state: the line sent users to a setting that fails the same way."""
    message = _trainer_message(monkeypatch, {k: v for k, v in GOOD.items() if "embedding_optimizer" not in k})
    assert STRICT_LOADING_ADVICE not in message
    assert "`strict_loading = False` does not skip" in message and "load_unsharded" in message
    assert "EmbeddingOptimizerConfig(name=" not in message  # the same optimizer: switching would not help


def test_under_a_trainer_another_embedding_optimizer_does_not_suggest_strict_loading(monkeypatch) -> None:
    saved = {k: v for k, v in GOOD.items() if "embedding_optimizer" not in k} | {state_key(T0, "momentum1"): (5, 4)}
    message = _trainer_message(monkeypatch, saved, saved_optimizer="adagrad")
    assert STRICT_LOADING_ADVICE not in message
    assert "EmbeddingOptimizerConfig(name='adagrad')" in message and "load_unsharded" in message


def test_under_a_trainer_a_resized_table_does_not_suggest_strict_loading(monkeypatch) -> None:
    message = _trainer_message(monkeypatch, {**GOOD, f"model.{T0}": (6, 4), state_key(T0, ROWWISE_MOMENTUM): (6,)})
    assert STRICT_LOADING_ADVICE not in message and "num_embeddings" in message


@pytest.mark.parametrize(
    "saved",
    [
        {k: v for k, v in GOOD.items() if k != "model.over.weight"},  # a dense key missing
        {k.replace(".t0.", ".t0_old."): v for k, v in GOOD.items()},  # a renamed (missing) table
        {**GOOD, "model.extra.bias": (3,)},  # a key the model lacks
    ],
    ids=["missing-dense-key", "missing-table", "extra-key"],
)
def test_under_a_trainer_keys_on_one_side_suggest_strict_loading(monkeypatch, saved) -> None:
    assert STRICT_LOADING_ADVICE in _trainer_message(monkeypatch, saved)


def test_a_tensor_declared_with_another_dtype_is_refused_before_anything_is_read() -> None:
    from lightning_recsys.checkpoint.validation import model_entries

    model_state = {"over.weight": torch.zeros(1, 8), "over.bias": torch.zeros(1)}
    metadata = Metadata(
        state_dict_metadata={
            "model.over.weight": TensorStorageMetadata(properties=TensorProperties(dtype=torch.float64), size=torch.Size((1, 8)), chunks=[]),
            "model.over.bias": TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size((1,)), chunks=[]),
        }
    )
    with pytest.raises(CheckpointMismatchError) as info:
        check_entries(model_entries(model_state, set()), metadata, path=Path("/ckpt"), strict=True, optimizer_name=None, saved_optimizer=None)
    message = str(info.value)
    assert "'over.weight'" in message or "over.weight" in message
    assert "declares dtype torch.float64, the model holds torch.float32" in message and "over.bias" not in message
    assert "another dtype" in _fix(message)

"""InitFromCheckpoint under TwoDRecStrategy (gloo): a SequencePretrainer fitted 1D table-wise warm-starts a SASRec
SequenceRanker row-wise on 2 processes and 2D on 4, exactly as loading its weights by hand; mismatches raise on
every rank before anything is read; a resumed fit keeps its own state."""

from __future__ import annotations

import logging
from functools import partial

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_recsys.testing.oracle import RecordPipeline, assemble
from lightning_recsys.testing.oracle.pretrain import ITEMS, MAX_LENGTH, PretrainDataModule
from lightning_recsys.testing.oracle.pretrain import make_model as make_pretrainer
from lightning_recsys.testing.oracle.pretrain import sgd_strategy as pretrain_strategy
from lightning_recsys.testing.oracle.sequence import ACTIONS, CONTEXT, NUM_DENSE, SequenceDataModule, SequenceLogConfig, sgd_strategy
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys.callbacks import InitFromCheckpoint
from lightning_recsys.checkpoint import export_safetensors, to_lightning_checkpoint
from lightning_recsys.models import SequenceRanker
from lightning_recsys.models.encoders import SASRecEncoder
from lightning_recsys.parallel.sharding.sharded_model import local_shards

ITEM_KEY = "item_embeddings.embeddings.item.weight"  # the same name in the pretrainer and the ranker
INCLUDE = ["item_embeddings.embeddings.item.*", "encoder.*"]  # the ranker has 4 actions, the pretrainer 3


def make_ranker(seed: int = 7, **overrides: object) -> SequenceRanker:
    torch.manual_seed(seed)
    arguments = dict(
        item_table_size=ITEMS, num_action_types=ACTIONS, context_feature_names=list(CONTEXT), context_table_sizes=list(CONTEXT.values()),
        num_dense_features=NUM_DENSE, embedding_dim=8, max_history=MAX_LENGTH,
        encoder=partial(SASRecEncoder, num_layers=2, num_heads=2, dropout=0.0), over_arch_layer_sizes=[8, 1], dense_optimizer="sgd", dense_lr=0.1,
    )
    return SequenceRanker(**{**arguments, **overrides})  # type: ignore[arg-type]


def table_shards(model: SequenceRanker) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    return {k: [(o, t.clone()) for o, t in v] for k, v in local_shards(model).items() if k.startswith(("item_embeddings.", "context_"))}


class _StateAtTrainStart(Callback):
    """The tables' shards and the dense state when training starts (after InitFromCheckpoint, listed before it)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.shards = table_shards(pl_module)
        self.dense = {k: v.detach().clone() for k, v in pl_module.state_dict().items() if not k.startswith(("item_embeddings.", "context_"))}


def _pretrain(rank: int, world_size: int, directory: str, two_d: bool = False) -> None:
    model = make_pretrainer(embedding_device="meta", seed=100 + rank)
    strategy = pretrain_strategy(sharding_types=["row_wise" if two_d else "table_wise"], **({"sharding_group_size": 2} if two_d else {}))
    trainer = Trainer(
        accelerator="cpu", devices=2 if two_d else world_size, num_nodes=2 if two_d else 1, strategy=strategy, max_steps=2,
        limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=directory, filename="pretrained")],
    )
    trainer.fit(model, datamodule=PretrainDataModule())


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("pretrain")
    run_ranks(_pretrain, 2, str(directory), timeout=300)
    path = directory / "pretrained.ckpt"
    return str(path), to_lightning_checkpoint(path)["state_dict"]  # the weights, read by hand


def test_warm_start_2d_row_wise_into_1d_table_wise_on_2_processes(tmp_path):
    """Pre-trained in 2D (2 x 2, row-wise), fine-tuned 1D on 2 processes."""
    run_ranks(_pretrain, 4, str(tmp_path), True, timeout=300, ranks_per_node=2)
    path = tmp_path / "pretrained.ckpt"
    source = to_lightning_checkpoint(path)["state_dict"]
    results = run_ranks(_fine_tune, 2, str(path), False, None, "table_wise", timeout=300)
    _check_warm_start(results, source, row_wise=False)
    # What the INFO line reports of the source, read from its meta.json.
    assert results[0]["saved_by"] == "4 ranks, 2D: 2 replicas x sharding groups of 2; action row_wise, item row_wise", results[0]["saved_by"]


def _fine_tune(rank: int, world_size: int, path: str, two_d: bool, resume_dir: str | None, sharding_type: str = "row_wise") -> dict:
    kwargs = {"sharding_group_size": 2} if two_d else {}
    state, warm = _StateAtTrainStart(), InitFromCheckpoint(path, include=INCLUDE)
    record = RecordPipeline()
    callbacks: list[Callback] = [warm, state, record]
    if resume_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=resume_dir, filename="tuned"))
    trainer = Trainer(
        accelerator="cpu", devices=2 if two_d else world_size, num_nodes=2 if two_d else 1, max_steps=1,
        strategy=sgd_strategy(sharding_types=[sharding_type], **kwargs), limit_val_batches=0, logger=False,
        enable_checkpointing=resume_dir is not None, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    model = make_ranker()
    trainer.fit(model, datamodule=SequenceDataModule(SequenceLogConfig()))
    out = {"shards": state.shards, "dense": state.dense, "loaded": warm.result.loaded, "saved_by": warm.result.saved_by, "pipeline": (record.disabled_reason, sorted(record.pipelined))}
    if resume_dir is None:
        return out
    # A resumed fit: the warm start is skipped (one INFO line), the checkpoint's state wins.
    out["tuned"] = {"shards": table_shards(model), "dense": {k: v.detach().clone() for k, v in model.state_dict().items() if k in state.dense}}
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(handler)
    resumed_state, resumed_warm = _StateAtTrainStart(), InitFromCheckpoint(path, include=INCLUDE)
    trainer = Trainer(
        accelerator="cpu", devices=world_size, max_steps=2, strategy=sgd_strategy(sharding_types=["row_wise"]), limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[resumed_warm, resumed_state],
    )
    trainer.fit(make_ranker(seed=8), datamodule=SequenceDataModule(SequenceLogConfig()), ckpt_path=f"{resume_dir}/tuned.ckpt")
    out["resumed"] = {"shards": resumed_state.shards, "dense": resumed_state.dense, "result": resumed_warm.result}
    out["skip_lines"] = [line for line in lines if line.startswith("InitFromCheckpoint")]
    return out


def _check_warm_start(results: list[dict], source: dict[str, torch.Tensor], row_wise: bool = True) -> None:
    fresh = make_ranker().state_dict()
    item = assemble([r["shards"] for r in results], ITEM_KEY, source[ITEM_KEY])
    assert torch.equal(item, source[ITEM_KEY])
    assert not torch.equal(fresh[ITEM_KEY], source[ITEM_KEY])
    encoder_keys = [k for k in source if k.startswith("encoder.")]
    for result in results:
        assert sorted(result["loaded"]) == sorted([ITEM_KEY, *encoder_keys])
        for key in encoder_keys:
            assert torch.equal(result["dense"][key], source[key]), key
        for key in [k for k in fresh if k.startswith("over_arch.")]:  # not in include: as initialized
            assert torch.equal(result["dense"][key], fresh[key]), key
        # The SASRec path keeps TorchRec's sparse-dist pipeline (its data-dependent ops are fx leaves).
        assert result["pipeline"] == (None, ["context_embeddings", "item_embeddings"]), result["pipeline"]
    if not row_wise:  # table-wise: one rank holds the whole item table
        assert sorted(len(r["shards"].get(ITEM_KEY, [])) for r in results) == [0, 1]
        return
    # Row-wise: every rank holds a block of rows of the item table.
    assert all(len(r["shards"][ITEM_KEY]) == 1 and r["shards"][ITEM_KEY][0][1].shape[0] < ITEMS for r in results)


def test_warm_start_1d_table_wise_into_1d_row_wise_on_2_processes_and_a_resumed_fit_skips_it(pretrained, tmp_path):
    path, source = pretrained
    results = run_ranks(_fine_tune, 2, path, False, str(tmp_path), timeout=300)
    _check_warm_start(results, source)
    tuned = [r["tuned"] for r in results]
    for rank, result in enumerate(results):
        resumed = result["resumed"]
        assert resumed["result"] is None
        assert resumed["shards"].keys() == tuned[rank]["shards"].keys()
        for key, pieces in resumed["shards"].items():
            for (offsets, tensor), (tuned_offsets, tuned_tensor) in zip(pieces, tuned[rank]["shards"][key], strict=True):
                assert offsets == tuned_offsets and torch.equal(tensor, tuned_tensor), key
        for key, value in tuned[rank]["dense"].items():
            assert torch.equal(resumed["dense"][key], value), key
    assert len(results[0]["skip_lines"]) == 1 and "skipped the warm start" in results[0]["skip_lines"][0]
    assert "tuned.ckpt" in results[0]["skip_lines"][0]


def test_warm_start_from_a_safetensors_export_into_row_wise_shards(pretrained, tmp_path):
    path, source = pretrained
    exported = export_safetensors(path, tmp_path / "pretrained.safetensors")
    results = run_ranks(_fine_tune, 2, str(exported), False, None, timeout=300)
    _check_warm_start(results, source)


def test_warm_start_1d_table_wise_into_2d_row_wise_on_4_processes(pretrained):
    path, source = pretrained
    results = run_ranks(_fine_tune, 4, path, True, None, timeout=400, ranks_per_node=2)
    _check_warm_start(results, source)


def _mismatch(rank: int, world_size: int, path: str, include: list[str] | None) -> str:
    trainer = Trainer(
        accelerator="cpu", devices=world_size, max_steps=1, strategy=sgd_strategy(sharding_types=["row_wise"]), limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[InitFromCheckpoint(path, include=include)],
    )
    try:
        trainer.fit(make_ranker(max_history=MAX_LENGTH + 1), datamodule=SequenceDataModule(SequenceLogConfig()))
    except Exception as error:  # noqa: BLE001 - the test reads every rank's error
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize(
    ("include", "expected"),
    [
        (INCLUDE, r"CheckpointMismatchError: .*parameter 'encoder\.positions': the checkpoint has shape \(6, 8\), the model has \(7, 8\)"),
        (None, r"CheckpointMismatchError: .*table 'action' 'item_embeddings\.embeddings\.action\.weight': the checkpoint has shape \(3, 8\), the model has \(4, 8\)"),
        (["encoder.*", "dense_arch.*"], r"ValueError: include pattern\(s\) \['dense_arch\.\*'\] match no tensor"),
    ],
    ids=["parameter_shape", "table_shape", "include_matches_nothing"],
)
def test_every_rank_raises_before_reading(pretrained, include, expected):
    import re

    path, _ = pretrained
    for rank, message in enumerate(run_ranks(_mismatch, 2, path, include, timeout=300)):
        assert re.search(expected, message, re.S), f"rank {rank}: {message}"

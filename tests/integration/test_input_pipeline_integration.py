"""pipeline="sparse_dist" against pipeline="off", with real processes (gloo): bit-identical on CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_recsys.testing.oracle.click import make_model, sgd_strategy, shards_of
from lightning_recsys.testing.processes import run_ranks
from torch.utils.data import DataLoader, IterableDataset
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_recsys import ReplicaSyncConfig
from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogConfig, SyntheticClickLogDataModule, slice_batch

CONFIG = SyntheticClickLogConfig(
    table_sizes=[40, 64, 24], num_dense_features=4, pooling_factors=[2.0, 3.0, 1.0],
    global_batch_size=16, train_batches=4, val_batches=2, seed=7,
)


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.sparse_ids_bytes: list[int] = []
        self.handshakes: list[int] = []  # batch handshakes filed under each training step
        self.pipelined: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.sparse_ids_bytes.append(trainer.strategy.comm_accounting.bytes_by(purpose="sparse_ids")[0])
        last_step = trainer.strategy.comm_accounting.last_step
        self.handshakes.append(sum(t.calls for k, t in last_step.items() if k.purpose == "batch_handshake"))
        pipeline = trainer.strategy._input_pipeline
        self.pipelined |= set(pipeline.pipelined_modules if pipeline is not None else [])


def _fit(rank: int, world_size: int, pipeline: str, sharding_type: str, **strategy_kwargs) -> dict:
    record = _Record()
    per_node = min(world_size, 2)  # 4 ranks: 2 emulated nodes of 2
    strategy = sgd_strategy(sharding_types=[sharding_type], pipeline=pipeline, **strategy_kwargs)
    trainer = Trainer(
        accelerator="cpu", devices=per_node, num_nodes=world_size // per_node, strategy=strategy, max_epochs=2, val_check_interval=2,
        limit_val_batches=2, num_sanity_val_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        tested = trainer.test(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG), verbose=False)
        predicted = trainer.predict(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    return {
        "losses": record.losses,
        "sparse_ids_bytes": record.sparse_ids_bytes,
        "handshakes": record.handshakes,
        "shards": shards_of(model),
        "val": metrics,
        "test": tested,
        "predict": [p.clone() for p in predicted],
        "pipeline_warnings": [str(w.message) for w in caught if "pipeline=" in str(w.message)],
        "pipelined": record.pipelined,
        "closed": strategy._input_pipeline is None,
        "forwards_restored": all(
            not type(m.forward).__name__.endswith("Forward") for m in model.modules() if hasattr(m, "_input_dists")
        ),
    }


def _on_and_off(rank: int, world_size: int, sharding_types: list[str], strategy_kwargs: dict) -> dict:
    return {
        (sharding_type, pipeline): _fit(rank, world_size, pipeline, sharding_type, **strategy_kwargs)
        for sharding_type in sharding_types for pipeline in ("off", "sparse_dist")
    }


def _assert_identical(off: dict, on: dict, rank: int) -> None:
    assert len(on["losses"]) == len(off["losses"]) == 2 * CONFIG.train_batches
    assert on["losses"] == off["losses"], rank  # bit for bit
    assert on["sparse_ids_bytes"] == off["sparse_ids_bytes"], rank
    for key, pieces in off["shards"].items():
        for (offsets, expected), (on_offsets, actual) in zip(pieces, on["shards"][key]):
            assert offsets == on_offsets and torch.equal(actual, expected), f"rank {rank}: {key}"
    assert on["val"] == off["val"] and on["test"] == off["test"], rank
    assert all(torch.equal(a, b) for a, b in zip(on["predict"], off["predict"])) and len(on["predict"]) == len(off["predict"])
    assert on["pipeline_warnings"] == [] and on["forwards_restored"] and on["closed"], on["pipeline_warnings"]
    assert on["pipelined"] == {"dlrm.sparse_arch.embedding_bag_collection"} and off["pipelined"] == set()


def test_pipeline_matches_off_bit_for_bit_in_1d() -> None:
    kinds = ["table_wise", "row_wise", "column_wise"]
    results = run_ranks(_on_and_off, 2, kinds, {}, timeout=400)
    for rank, result in enumerate(results):
        for kind in kinds:
            _assert_identical(result[(kind, "off")], result[(kind, "sparse_dist")], rank)


def test_evaluation_batch_handshakes_are_not_filed_under_the_next_training_step() -> None:
    # Before: with pipeline="off" the handshakes of the sanity check's and every validation's batches
    # were kept for the next training step (5 instead of 1 or 2 after each validation here); the
    # pipeline drops them, as it should: they feed no training step.
    results = run_ranks(_on_and_off, 2, ["table_wise"], {}, timeout=300)
    for rank, result in enumerate(results):
        off, on = result[("table_wise", "off")], result[("table_wise", "sparse_dist")]
        print(f"rank {rank}: handshakes per step, off {off['handshakes']}, sparse_dist {on['handshakes']}")
        assert off["handshakes"] == on["handshakes"], rank
        # Each step's own batch handshake, and an epoch's first step also the one for the batch after it.
        assert off["handshakes"] == [2, 1, 1, 1] * 2, rank


@pytest.mark.slow
def test_pipeline_matches_off_bit_for_bit_in_2d_with_replica_sync() -> None:
    kwargs = {"sharding_group_size": 2, "replica_sync": ReplicaSyncConfig(every_n_steps=1)}
    results = run_ranks(_on_and_off, 4, ["row_wise"], kwargs, timeout=400, ranks_per_node=2)
    for rank, result in enumerate(results):
        _assert_identical(result[("row_wise", "off")], result[("row_wise", "sparse_dist")], rank)


# Rank 0's and rank 1's batch sizes: batch 2 is empty on rank 0 (every rank skips it), batch 4 has
# unequal sizes (row-wise skips it, table-wise runs it), rank 1 runs out first (rank 0's batch 5 is dropped).
_SIZES = {0: [8, 8, 0, 8, 6, 8], 1: [8, 8, 8, 8, 3]}


class _Unsized(IterableDataset):
    """No ``__len__``: Lightning then fetches a batch ahead of the step that runs it."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class _Uneven(LightningDataModule):
    def __init__(self, rank: int, sized: bool = True) -> None:
        super().__init__()
        log = SyntheticClickLog(CONFIG)
        self.batches = [slice_batch(log.global_batch("train", i % 4), 0, size) for i, size in enumerate(_SIZES[rank])]
        self.sized = sized

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches if self.sized else _Unsized(self.batches), batch_size=None)  # type: ignore[arg-type]

    val_dataloader = train_dataloader


class _Counters(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        loader = trainer.train_dataloader
        self.counts = (loader.skipped_steps, loader.dropped_batches)


def _fit_uneven(rank: int, world_size: int, sharding_type: str) -> dict:
    results = {}
    for run in ("off", "sparse_dist", "off unsized", "sparse_dist unsized"):
        pipeline = run.split()[0]
        record, counters = _Record(), _Counters()
        trainer = Trainer(
            accelerator="cpu", devices=world_size, strategy=sgd_strategy(sharding_types=[sharding_type], pipeline=pipeline),
            max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[record, counters],
            use_distributed_sampler=False,  # each rank's batches are its own already (_SIZES): no re-split
        )
        model = make_model()
        trainer.fit(model, datamodule=_Uneven(rank, sized="unsized" not in run))
        results[run] = {
            "losses": record.losses, "counts": counters.counts, "shards": shards_of(model), "steps": trainer.global_step,
            "val": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
        }
    return results


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_uneven_epochs_and_skipped_steps_behave_as_without_the_pipeline(sharding_type: str) -> None:
    for rank, result in enumerate(run_ranks(_fit_uneven, 2, sharding_type, timeout=300)):
        for suffix in ("", " unsized"):  # unsized: Lightning fetches a batch ahead of its step
            off, on = result["off" + suffix], result["sparse_dist" + suffix]
            assert off["steps"] == on["steps"] >= 2 and len(on["losses"]) == on["steps"]
            assert on["losses"] == off["losses"] and on["counts"] == off["counts"], rank
            # Per epoch (2 epochs): skipped, the empty batch (and under row-wise the 6-against-3 one); dropped, rank 0's 6th.
            assert on["counts"] == ((2, 2) if sharding_type == "table_wise" else (4, 2)), (rank, on["counts"])
            assert on["val"] == off["val"], rank
            for key, pieces in off["shards"].items():
                assert all(torch.equal(a, b) for (_, a), (_, b) in zip(pieces, on["shards"][key])), f"rank {rank}: {key}"


def _checkpoint_and_resume(rank: int, world_size: int, ckpt_dir: str) -> dict:
    results = {}
    for pipeline in ("off", "sparse_dist"):
        directory = f"{ckpt_dir}/{pipeline}"
        losses = []
        runs = [(3, None, directory), (-1, "last", directory), (-1, None, f"{directory}-whole")]  # stopped, resumed, whole
        for run, (max_steps, ckpt_path, run_dir) in enumerate(runs):
            record = _Record()
            trainer = Trainer(
                accelerator="cpu", devices=world_size, strategy=sgd_strategy(sharding_types=["row_wise"], pipeline=pipeline),
                max_epochs=2, max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                limit_val_batches=0, callbacks=[record, ModelCheckpoint(dirpath=run_dir, save_last=True, every_n_train_steps=3)],
            )
            model = make_model()
            trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG), ckpt_path=ckpt_path)
            losses.append(record.losses)
            if run == 1:
                resumed = {"shards": shards_of(model), "steps": trainer.global_step}
        results[pipeline] = {"losses": losses[:2], "whole": losses[2], **resumed}
    return results


def test_mid_epoch_checkpoint_and_resume_through_the_pipeline_match_off(tmp_path) -> None:
    for rank, result in enumerate(run_ranks(_checkpoint_and_resume, 2, str(tmp_path), timeout=400)):
        off, on = result["off"], result["sparse_dist"]
        assert len(on["losses"][0]) == 3 and on["steps"] == off["steps"] == 2 * CONFIG.train_batches  # stopped mid-epoch 0
        assert on["losses"] == off["losses"], rank
        # Resumed mid-epoch at the next batch: stopped + resumed steps are the uninterrupted run's.
        assert off["losses"][0] + off["losses"][1] == off["whole"] == on["whole"], rank
        for key, pieces in off["shards"].items():
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(pieces, on["shards"][key])), f"rank {rank}: {key}"


class _Placement(Callback):
    """Where the batch is when the step gets it, and whether Lightning's transfer made new tensors."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.devices.add(batch.dense.device.type)


def _fit_cuda(rank: int, world_size: int) -> dict:
    results = {}
    for pipeline in ("off", "sparse_dist"):
        record, placement = _Record(), _Placement()
        trainer = Trainer(
            accelerator="cuda", devices=1, strategy=sgd_strategy(sharding_types=["table_wise"], pipeline=pipeline),
            max_epochs=1, limit_val_batches=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[record, placement],
        )
        model = make_model()
        copies = []
        original_to = torch.Tensor.to

        def counting_to(self, *args, **kwargs):  # host-to-device copies of the batch
            result = original_to(self, *args, **kwargs)
            if self.device.type == "cpu" and result.device.type == "cuda":
                copies.append(tuple(self.shape))
            return result

        torch.Tensor.to = counting_to
        try:
            trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
        finally:
            torch.Tensor.to = original_to
        results[pipeline] = {"losses": record.losses, "devices": placement.devices, "copies": len(copies),
                             "pipelined": record.pipelined}
    return results


@pytest.mark.gpu
def test_on_cuda_the_copy_and_distribution_run_on_side_streams_and_match_off() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    (result,) = run_ranks(_fit_cuda, 1, timeout=300)
    off, on = result["off"], result["sparse_dist"]
    assert on["devices"] == off["devices"] == {"cuda"}
    assert on["pipelined"] == {"dlrm.sparse_arch.embedding_bag_collection"}
    torch.testing.assert_close(torch.tensor(on["losses"]), torch.tensor(off["losses"]), rtol=1e-6, atol=1e-7)
    assert on["copies"] == off["copies"] > 0  # one copy per batch: Lightning's transfer finds it on the device


class _DictBatches(IterableDataset):
    """This rank's slices of the global batches, as dicts."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.local = rank, CONFIG.global_batch_size // world_size

    def __iter__(self):
        log = SyntheticClickLog(CONFIG)
        for step in range(CONFIG.train_batches):
            batch = slice_batch(log.global_batch("train", step), self.rank * self.local, (self.rank + 1) * self.local)
            yield {"dense": batch.dense, "sparse": batch.sparse, "labels": batch.labels}


class _BranchingRanker(LightningModule):
    """Reads dict batches and RecBatches alike: fx tracing follows the RecBatch branch (``isinstance`` is False
    for a proxy), so the traced path to the module's input (``batch.sparse``) does not apply to the real batch."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"sparse_{i}"])
            for i, rows in enumerate(CONFIG.table_sizes)
        ])
        self.head = torch.nn.Linear(8 * len(CONFIG.table_sizes) + CONFIG.num_dense_features, 1)

    def forward(self, batch) -> torch.Tensor:
        if isinstance(batch, dict):
            dense, sparse = batch["dense"], batch["sparse"]
        else:
            dense, sparse = batch.dense, batch.sparse
        return self.head(torch.cat([self.ebc(sparse).values(), dense], dim=1)).squeeze(-1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.binary_cross_entropy_with_logits(self(batch), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_DictBatches(self.global_rank, self.trainer.world_size), batch_size=None)


def _fit_branching(rank: int, world_size: int) -> dict:
    results = {}
    for pipeline in ("off", "sparse_dist"):
        torch.manual_seed(0)
        record = _Record()
        trainer = Trainer(
            accelerator="cpu", devices=world_size, strategy=sgd_strategy(pipeline=pipeline), max_steps=CONFIG.train_batches,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_BranchingRanker())
        results[pipeline] = {"losses": record.losses, "warnings": [str(w.message) for w in caught if "pipeline=" in str(w.message)]}
    return results


def test_a_traced_input_path_that_the_batch_does_not_have_falls_back_to_off_with_a_warning() -> None:
    # The trace succeeded, but reading the module's input from the first real batch raised
    # AttributeError ('dict' object has no attribute 'sparse') out of the dataloader on every rank.
    for rank, result in enumerate(run_ranks(_fit_branching, 2, timeout=300)):
        assert len(result["off"]["losses"]) == CONFIG.train_batches
        assert result["sparse_dist"]["losses"] == result["off"]["losses"], rank
        if rank == 0:
            (warning,) = result["sparse_dist"]["warnings"]
            assert "'ebc'" in warning and "AttributeError" in warning and "pipeline='off' avoids this" in warning, warning

"""Lightning features on TwoDRecStrategy: mixed precision, LR schedules on the tables, gradient clipping, an empty fit,
manual optimization."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning_recsys.testing.oracle.click import assert_matches, fit_sharded, make_model, sgd_strategy, shards_of, train_unsharded
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import EmbeddingOptimizerConfig, TableConstraints, TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.models import DLRMRanker
from lightning_recsys.planner.config import PlanningConfig

CONFIG = SyntheticClickLogConfig(table_sizes=[200, 100], num_dense_features=4, global_batch_size=64, train_batches=6, val_batches=1, seed=5)
BF16_LOSS_ATOL = 2e-2  # bf16 keeps 8 mantissa bits: about 4e-3 relative per op, on a BCE loss near 0.69


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class _ScheduledRanker(DLRMRanker):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5), "interval": "step"}}


class _PlateauRanker(DLRMRanker):
    """ReduceLROnPlateau on a metric that never improves: the rate halves after every step but the first."""

    def training_step(self, batch, batch_idx):
        self.log("flat", 1.0)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "interval": "step", "monitor": "flat"}}


def _model(cls=DLRMRanker) -> DLRMRanker:
    torch.manual_seed(0)
    return cls(table_sizes=CONFIG.table_sizes, num_dense_features=4, embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1])


def _fit(rank: int, world_size: int, precision: str) -> list[float]:
    losses = _Losses()
    trainer = Trainer(
        accelerator="cpu", devices=world_size, precision=precision, max_epochs=1, limit_val_batches=0, logger=False,
        strategy=TwoDRecStrategy(process_group_timeout=60, embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=0.1)),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
    )
    trainer.fit(_model(), datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    return losses.losses


@pytest.mark.slow
def test_bf16_mixed_fits_and_its_loss_stays_close_to_fp32():
    fp32 = run_ranks(_fit, 2, "32-true", timeout=180)[0]
    bf16 = run_ranks(_fit, 2, "bf16-mixed", timeout=180)[0]
    assert len(bf16) == len(fp32) == CONFIG.train_batches
    assert bf16 != fp32  # autocast really ran in bf16
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), atol=BF16_LOSS_ATOL, rtol=0)


class _EmbeddingLr(Callback):
    def __init__(self) -> None:
        self.seen: list[list[float]] = []

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # the rate FBGEMM uses in this backward
        self.seen.append(trainer.strategy.embedding_learning_rate.fused_lrs())


def _scheduled_trainer(world_size: int, follows: bool, max_steps: int, seen: _EmbeddingLr, clip: float | None = None) -> Trainer:
    """Fused tables at lr 0.4, table-wise, following the module's scheduler when ``follows``; ``seen`` records their rates."""
    strategy = TwoDRecStrategy(
        process_group_timeout=60, embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=0.4, lr_follows_scheduler=follows),
        planning=PlanningConfig(sharding_types=["table_wise"]),
    )
    return Trainer(
        accelerator="cpu", devices=world_size, max_steps=max_steps, limit_val_batches=0, logger=False, gradient_clip_val=clip,
        strategy=strategy, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[seen],
    )


def _fit_scheduled(rank: int, world_size: int, follows: bool, clip: float | None, ranker: type = _ScheduledRanker) -> dict:
    seen = _EmbeddingLr()
    trainer = _scheduled_trainer(world_size, follows, 4, seen, clip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_model(ranker), datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    clip_warnings = [str(w.message) for w in caught if "gradient_clip_val" in str(w.message)]
    return {"seen": seen.seen, "clip_warnings": clip_warnings}


def test_embedding_lr_follows_the_first_scheduler_when_asked():
    followed = run_ranks(_fit_scheduled, 2, True, None, timeout=180)
    for result in followed:
        # StepLR(gamma=0.5) every step: the fused tables see 0.4, 0.2, 0.1, 0.05 before steps 0..3.
        assert [lrs[0] for lrs in result["seen"]] == pytest.approx([0.4, 0.2, 0.1, 0.05])
        assert all(len(set(lrs)) == 1 for lrs in result["seen"])  # every fused module got it
    fixed = run_ranks(_fit_scheduled, 2, False, None, timeout=180)
    assert [lrs[0] for lrs in fixed[0]["seen"]] == pytest.approx([0.4] * 4)


def test_embedding_lr_follows_reduce_lr_on_plateau():
    # ReduceLROnPlateau sets no initial_lr; the factor was lr / lr = 1 and the tables kept 0.4 throughout.
    results = run_ranks(_fit_scheduled, 2, True, None, _PlateauRanker, timeout=180)
    for result in results:
        assert [lrs[0] for lrs in result["seen"]] == pytest.approx([0.4, 0.4, 0.2, 0.1])


def _fit_scheduled_twice(rank: int, world_size: int) -> list[list[float]]:
    """The same module fitted by two Trainers (docs/strategy.md's reuse of a sharded module), the tables following
    StepLR(gamma=0.5) in both; returns the rate FBGEMM used in each backward of each fit."""
    model = _model(_ScheduledRanker)
    seen_by_fit = []
    for follows in (True, True, False):
        seen = _EmbeddingLr()
        trainer = _scheduled_trainer(world_size, follows, 3, seen)
        trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
        seen_by_fit.append([lrs[0] for lrs in seen.seen])
    return seen_by_fit


def test_a_second_fit_of_the_same_module_starts_the_tables_at_the_configured_lr():
    # Before: the first fit left FBGEMM at 0.4 * 0.25; the next fit's factor started at 1.0, equal to the
    # one assumed, so it was never applied and the tables trained their first step at 0.1, not 0.4
    # (and a fit that does not follow a scheduler kept 0.1 throughout).
    for seen in run_ranks(_fit_scheduled_twice, 2, timeout=180):
        assert seen[0] == pytest.approx([0.4, 0.2, 0.1])
        assert seen[1] == pytest.approx([0.4, 0.2, 0.1])
        assert seen[2] == pytest.approx([0.4, 0.4, 0.4])


def test_gradient_clipping_warns_once_that_fused_tables_are_not_clipped():
    results = run_ranks(_fit_scheduled, 2, False, 1.0, timeout=180)
    assert len(results[0]["clip_warnings"]) == 1, results[0]["clip_warnings"]
    assert "FBGEMM" in results[0]["clip_warnings"][0]


class _NoBatches(torch.utils.data.IterableDataset):
    """An iterable split that yields nothing and has no length, like a Criteo file shorter than one global batch."""

    def __iter__(self):
        return iter(())


class _EmptyTrainData(SyntheticClickLogDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(_NoBatches(), batch_size=None)


def _fit_without_batches(rank: int, world_size: int) -> list[str]:
    trainer = Trainer(
        accelerator="cpu", devices=world_size, max_epochs=1, limit_val_batches=0, logger=False,
        strategy=TwoDRecStrategy(process_group_timeout=60), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_model(), datamodule=_EmptyTrainData.from_config(CONFIG))
    return [str(w.message) for w in caught if "no training step" in str(w.message)]


def test_a_fit_that_got_no_batch_says_so():
    warned = run_ranks(_fit_without_batches, 2, timeout=180)
    assert len(warned[0]) == 1 and "global_batch_size" in warned[0][0], warned[0]
    assert warned[1] == []  # rank 0 speaks for all


class _ManualRanker(DLRMRanker):
    """Steps its own optimizer (``automatic_optimization = False``), as GAN-style or custom loops do."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.manual_backward(loss)
        optimizer.step()
        return loss


def _fit_manually(rank: int, world_size: int) -> dict:
    # One table data_parallel: its gradient goes through the same DDP as the dense layers'.
    planning = PlanningConfig(
        sharding_types=["row_wise", "data_parallel"],
        table_constraints={"t_sparse_2": TableConstraints(sharding_types=["data_parallel"])},
    )
    model, trainer, predictions = fit_sharded(rank, world_size, sgd_strategy(planning=planning), model=make_model(cls=_ManualRanker))
    return {"shards": shards_of(model), "predictions": predictions, "steps": trainer.global_step}


def test_manual_optimization_all_reduces_the_dense_gradients_and_equals_unsharded_sgd():
    # Before: manual_backward ran inside DDP's forward, before its reducer was prepared; every rank
    # stepped its own dense gradient (the replicas of the dense layers drifted apart).
    expected_state, expected_predictions = train_unsharded()
    results = run_ranks(_fit_manually, 2, timeout=180)
    assert [r["steps"] for r in results] == [3, 3]
    assert_matches([r["shards"] for r in results], [r["predictions"] for r in results], expected_state, expected_predictions)


class _EvenBatchStepper(_ManualRanker):
    """Steps its optimizer on even batches only; FBGEMM still updates the tables in every backward."""

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = F.binary_cross_entropy_with_logits(self(batch), batch.labels)
        self.manual_backward(loss)
        if batch_idx % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()
        return loss


def _fit_2d_manually(rank: int, world_size: int) -> dict:
    strategy = TwoDRecStrategy(
        process_group_timeout=60, sharding_group_size=2, embedding_optimizer=EmbeddingOptimizerConfig(name="sgd", lr=0.3),
        planning=PlanningConfig(sharding_types=["table_wise"]),
    )
    model = _model(_EvenBatchStepper)
    trainer = Trainer(
        accelerator="cpu", devices=world_size, max_steps=-1, limit_train_batches=4, max_epochs=1, limit_val_batches=0,
        logger=False, strategy=strategy, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    return {"shards": shards_of(model), "syncs": strategy.runtime.sync_totals.syncs}


def test_manual_optimization_syncs_the_replicas_after_every_batch_whatever_the_optimizer_did():
    # Before: the step ended at the first optimizer's step; batch 3 (not stepped) updated the tables
    # unseen by the replica sync, and fit ended with replicas 0.1 apart.
    results = run_ranks(_fit_2d_manually, 4, timeout=180)
    for rank, replica in ((0, 2), (1, 3)):
        assert results[rank]["shards"].keys() == results[replica]["shards"].keys()
        for key, pieces in results[rank]["shards"].items():
            for (_, mine), (_, theirs) in zip(pieces, results[replica]["shards"][key]):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert [r["syncs"] for r in results] == [4] * 4  # one per batch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-mixed needs CUDA: Lightning's fp16 AMP with a GradScaler runs on CUDA only")
def test_16_mixed_on_cuda_fits_with_unscaled_table_updates():
    def fit(rank: int, world_size: int) -> list[float]:
        losses = _Losses()
        trainer = Trainer(
            accelerator="gpu", devices=1, precision="16-mixed", max_epochs=1, limit_val_batches=0, logger=False,
            strategy=TwoDRecStrategy(process_group_timeout=60), enable_checkpointing=False, enable_progress_bar=False,
            callbacks=[losses],
        )
        trainer.fit(_model(), datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
        return losses.losses

    losses = run_ranks(fit, 1, timeout=300)[0]
    assert len(losses) == CONFIG.train_batches and all(torch.isfinite(torch.tensor(losses)))

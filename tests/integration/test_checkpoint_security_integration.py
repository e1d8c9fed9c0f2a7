"""validate(ckpt_path=...) under TwoDRecStrategy refuses a crafted pickle in host_state.pt on every rank, and never runs it."""

from __future__ import annotations

from pathlib import Path

from crafted_checkpoints import CONFIG, SideEffect, ranker, write_checkpoint
from lightning.pytorch import Trainer
from multiprocess import run_ranks

from lightning_recsys import TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLogDataModule


def _validate(rank: int, world_size: int, path: str) -> str:
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=TwoDRecStrategy(process_group_timeout=60), logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
    )
    try:
        trainer.validate(ranker(seed=1), datamodule=SyntheticClickLogDataModule(CONFIG), ckpt_path=path)
    except Exception as error:  # noqa: BLE001 - the refusal is the result
        return f"{type(error).__name__}: {error}"
    return "loaded"


def test_validate_refuses_a_crafted_host_state_on_every_rank(tmp_path: Path) -> None:
    marker = tmp_path / "the_payload_ran"
    source = ranker(seed=0)
    path = write_checkpoint(source, tmp_path / "last.ckpt", {"global_step": 5, "hyper_parameters": dict(source.hparams), "x": SideEffect(marker)})
    results = run_ranks(_validate, 2, str(path), timeout=150)
    assert all("Weights only load failed" in r for r in results), results
    assert not marker.exists(), "validate(ckpt_path) ran the pickled payload"

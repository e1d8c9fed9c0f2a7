"""RunSummary counts and times the steps of the fit it reports, however the fit started."""

from __future__ import annotations

from lightning.pytorch import Trainer
from summary_helpers import summary_rows, write_criteo_tsv

from lightning_recsys.callbacks import RunSummary, format_summary
from lightning_recsys.data import SyntheticClickLogConfig, SyntheticClickLogDataModule
from lightning_recsys.data.criteo.tsv import CriteoDataModule
from lightning_recsys.models import DLRMRanker

CONFIG = SyntheticClickLogConfig(table_sizes=[20, 10], num_dense_features=3, global_batch_size=16, train_batches=10, val_batches=1)


def _fit(max_steps: int, ckpt_path: str | None = None, summary: RunSummary | None = None, **trainer_kwargs) -> tuple[Trainer, RunSummary]:
    summary = summary or RunSummary(warmup_steps=2)
    model = DLRMRanker(table_sizes=CONFIG.table_sizes, num_dense_features=3, embedding_dim=4, dense_arch_layer_sizes=[4])
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[summary], **trainer_kwargs,
    )
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(CONFIG), ckpt_path=ckpt_path)
    return trainer, summary


def test_a_resumed_fit_leaves_its_own_first_steps_out_of_the_timing(tmp_path):
    # warmup_steps counted global steps: a fit resumed at step 4 timed its second step already.
    first, _ = _fit(4, default_root_dir=tmp_path)
    checkpoint = first.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    resumed, summary = _fit(10, ckpt_path=checkpoint, default_root_dir=tmp_path, enable_checkpointing=False)
    assert resumed.global_step == 10
    assert summary.summary["timed_steps"] == (10 - 4) - 2
    assert summary.summary["global_steps"] == 10


def test_a_second_fit_reports_its_own_steps_only():
    # The same callback in two fits: the second summary held both fits' steps and wall time.
    summary = RunSummary(warmup_steps=2)
    _fit(6, summary=summary, enable_checkpointing=False)
    assert summary.summary["timed_steps"] == 6 - 2
    _fit(5, summary=summary, enable_checkpointing=False)
    assert summary.summary["timed_steps"] == 5 - 2


def test_a_fit_without_steps_reports_no_timing():
    _, summary = _fit(0, enable_checkpointing=False)
    assert summary.summary["timed_steps"] == 0 and summary.summary["examples_per_sec"] is None


def test_the_summary_reports_the_malformed_lines_the_reader_skipped_without_twod_rec(tmp_path):
    # Before: 3 malformed lines were skipped (on_bad_line="skip") and the summary did not say so.
    data = CriteoDataModule([write_criteo_tsv(tmp_path / "day_0.tsv", good=8, bad_at=(0, 3, 8))], table_sizes=10,
                            global_batch_size=2, on_bad_line="skip", reader="python")
    model = DLRMRanker(table_sizes=data.table_sizes, num_dense_features=data.num_dense_features, feature_names=data.feature_names,
                       embedding_dim=4, dense_arch_layer_sizes=[4])
    summary = RunSummary(warmup_steps=1)
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, callbacks=[summary])
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 4
    assert summary.summary["skipped_input_lines_by_rank"] == [3]
    assert summary_rows(format_summary(summary.summary))["malformed input lines skipped"] == "3 on every rank"
    # Lightning's own strategy: no batch handshake, so no skipped steps or dropped batches to report.
    assert "skipped_steps" not in summary.summary and "dropped_batches" not in summary.summary
    # One rank: its batch sizes are all the examples there are.
    assert summary.summary["examples_timed"] == 2 * 3


def test_a_dataset_without_skipped_lines_reports_none():
    _, summary = _fit(4, enable_checkpointing=False)
    assert "skipped_input_lines_by_rank" not in summary.summary
    assert summary.summary["examples_timed"] == 2 * CONFIG.global_batch_size
    assert "malformed input lines skipped" not in summary_rows(format_summary(summary.summary))

"""The run summary's examples/s is wall-clock throughput over the timed steps, data loading included, counting
every rank's batches; the summary also says what the run skipped or dropped of the data."""

from __future__ import annotations

import time

import pytest
from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning_recsys.testing.oracle.click import CONFIG as ORACLE_CONFIG
from lightning_recsys.testing.oracle.click import make_model, sgd_strategy
from lightning_recsys.testing.processes import run_ranks
from summary_helpers import summary_rows, write_criteo_tsv
from torch.utils.data import DataLoader

from lightning_recsys import TwoDRecStrategy
from lightning_recsys.callbacks import RunSummary, format_summary
from lightning_recsys.data import (
    SyntheticClickLog,
    SyntheticClickLogConfig,
    SyntheticClickLogDataModule,
    slice_batch,
)
from lightning_recsys.data.criteo.tsv import CriteoDataModule
from lightning_recsys.models import DLRMRanker

CONFIG = SyntheticClickLogConfig(table_sizes=[50, 30], num_dense_features=3, global_batch_size=32, train_batches=12, val_batches=1)
LOADER_DELAY_S = 0.03


class _SlowData(SyntheticClickLogDataModule):
    """Each training batch takes LOADER_DELAY_S to load: outside the step's forward/backward/optimizer."""

    def train_dataloader(self):
        for batch in super().train_dataloader():
            time.sleep(LOADER_DELAY_S)
            yield batch


class _StepEnds(Callback):
    def __init__(self) -> None:
        self.ends: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append((trainer.global_step, time.perf_counter()))


def _fit(rank: int, world_size: int) -> dict:
    summary, ends = RunSummary(warmup_steps=2), _StepEnds()
    model = DLRMRanker(table_sizes=CONFIG.table_sizes, num_dense_features=3, embedding_dim=8, dense_arch_layer_sizes=[8, 8])
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=TwoDRecStrategy(process_group_timeout=60), max_epochs=1,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        # The reference marks come first: RunSummary's own work after its mark (its first pl_module.log of
        # examples_per_sec, at step 2, takes 13-27 ms here) is then inside both measurements, not only in RunSummary's.
        enable_model_summary=False, callbacks=[ends, summary],
    )
    trainer.fit(model, datamodule=_SlowData.from_config(CONFIG))
    return {"summary": summary.summary, "ends": ends.ends}


@pytest.mark.parametrize("world_size", [1])
def test_examples_per_sec_is_examples_over_the_wall_time_of_the_timed_steps(world_size):
    result = run_ranks(_fit, world_size, timeout=120)[0]
    summary, ends = result["summary"], result["ends"]
    timed = [(step, t) for step, t in ends if step > 2]
    wall = timed[-1][1] - next(t for step, t in ends if step == 2)
    expected = len(timed) * CONFIG.global_batch_size / wall
    assert summary["timed_steps"] == len(timed)
    assert summary["examples_per_sec"] == pytest.approx(expected, rel=0.05)
    # The loader's delay is in the wall clock, not in the forward/backward/optimizer split. Up to 3 batches are
    # loaded ahead of their step (Lightning's prefetch, the handshake's and the pipeline's lookahead), so up to 3 of
    # the timed steps' sleeps may fall before the window (this bound failed about 1 run in 3 as "per step >= delay").
    assert wall >= (len(timed) - 3) * LOADER_DELAY_S
    assert summary["step_time_ms"] / 1000 < wall / len(timed)


# Rank 0's and rank 1's batch sizes: batch 2 is empty on rank 0 (every rank skips it), batch 4 has unequal
# sizes (table-wise runs it with 6 + 3 examples; row-wise skips it), rank 1 runs out first (rank 0's batch 5 is dropped).
_SIZES = {0: [8, 8, 0, 8, 6, 8], 1: [8, 8, 8, 8, 3]}


class _Uneven(LightningDataModule):
    def __init__(self, rank: int) -> None:
        super().__init__()
        log = SyntheticClickLog(ORACLE_CONFIG)
        self.batches = [slice_batch(log.global_batch("train", i % 4), 0, size) for i, size in enumerate(_SIZES[rank])]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None)  # type: ignore[arg-type]


def _fit_uneven(rank: int, world_size: int) -> dict:
    results = {}
    for sharding_type in ("table_wise", "row_wise"):
        summary = RunSummary(warmup_steps=0)
        trainer = Trainer(
            accelerator="cpu", devices=world_size, strategy=sgd_strategy(sharding_types=[sharding_type]), max_epochs=1,
            limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[summary], use_distributed_sampler=False,  # each rank's own batches, all of them
        )
        trainer.fit(make_model(), datamodule=_Uneven(rank))
        results[sharding_type] = {"summary": summary.summary, "text": format_summary(summary.summary)}
    return results


def test_the_summary_reports_skipped_steps_dropped_batches_and_counts_every_ranks_examples():
    # Before: the summary said nothing of the steps the batch handshake skipped or the batches it dropped, and
    # counted rank 0's batch size times the world size (6 x 2 = 12 for step 4, where the ranks had 6 + 3 = 9).
    for rank, result in enumerate(run_ranks(_fit_uneven, 2, timeout=300)):
        table_wise, row_wise = result["table_wise"]["summary"], result["row_wise"]["summary"]
        assert table_wise["global_steps"] == 4 and row_wise["global_steps"] == 3, rank
        assert (table_wise["skipped_steps"], table_wise["dropped_batches"]) == (1, 1), rank
        assert (row_wise["skipped_steps"], row_wise["dropped_batches"]) == (2, 1), rank
        # warmup_steps=0: every step but the first (no earlier step end to time from) is timed.
        assert table_wise["timed_steps"] == 3 and table_wise["examples_timed"] == 16 + 16 + 9, rank
        assert row_wise["timed_steps"] == 2 and row_wise["examples_timed"] == 16 + 16, rank
        for summary in (table_wise, row_wise):
            assert summary["examples_per_sec"] == pytest.approx(summary["examples_timed"] / summary["wall_seconds_timed"])
            assert "skipped_input_lines_by_rank" not in summary  # the dataset counts no skipped lines
        rows = summary_rows(result["table_wise"]["text"])
        assert rows["steps skipped (empty or unequal batches)"] == "1", rows
        assert rows["batches dropped (uneven epoch ends)"] == "1", rows
        assert rows["examples (timed, all ranks)"] == "41", rows


def _fit_criteo(rank: int, world_size: int, path: str) -> dict:
    data = CriteoDataModule([path], table_sizes=10, global_batch_size=4, on_bad_line="skip", reader="python")
    model = DLRMRanker(table_sizes=data.table_sizes, num_dense_features=data.num_dense_features, feature_names=data.feature_names,
                       embedding_dim=4, dense_arch_layer_sizes=[4])
    summary = RunSummary(warmup_steps=0)
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=TwoDRecStrategy(process_group_timeout=60), max_epochs=1,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[summary],
    )
    trainer.fit(model, datamodule=data)
    return {"summary": summary.summary, "text": format_summary(summary.summary)}


def test_the_summary_reports_the_malformed_lines_each_rank_skipped_through_the_strategys_loader(tmp_path):
    # Before: the Criteo reader skipped (and counted) 3 malformed lines, and the summary did not say so.
    path = write_criteo_tsv(tmp_path / "day_0.tsv", good=12, bad_at=(1, 5, 9))
    for rank, result in enumerate(run_ranks(_fit_criteo, 2, path, timeout=300)):
        summary = result["summary"]
        assert summary["global_steps"] == 3, rank  # 12 good lines in global batches of 4
        # The Python reader reads and checks every line on every rank: each rank skipped the same 3.
        assert summary["skipped_input_lines_by_rank"] == [3, 3], rank
        assert (summary["skipped_steps"], summary["dropped_batches"]) == (0, 0), rank
        assert summary_rows(result["text"])["malformed input lines skipped"] == "3 on every rank", result["text"]

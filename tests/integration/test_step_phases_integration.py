"""Every step phase's profiler label is in the trace of ``Trainer(profiler=PyTorchProfiler(...))``: 2 processes, 2D."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.profilers import PyTorchProfiler
from lightning_recsys.testing.oracle.click import CONFIG, make_model, sgd_strategy
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys import ReplicaSyncConfig
from lightning_recsys.data import SyntheticClickLogDataModule
from lightning_recsys.parallel.step_phases import STEP_PHASES

pytestmark = pytest.mark.slow


def _profiled_fit(rank: int, world_size: int, out_dir: str) -> list[str]:
    # 2 nodes x 1 rank: sharding groups of 1, one replica group of 2; an overlapped sync every 2 steps
    # launches at step 2, sends its next piece at step 3 and is applied at step 4.
    strategy = sgd_strategy(sharding_group_size=1, replica_sync=ReplicaSyncConfig(every_n_steps=2, overlap=True))
    profiler = PyTorchProfiler(dirpath=Path(out_dir) / f"rank{rank}", filename="fit")
    trainer = Trainer(
        accelerator="cpu", devices=1, num_nodes=world_size, strategy=strategy, max_steps=4, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, profiler=profiler,
    )  # fmt: skip
    trainer.fit(make_model(), datamodule=SyntheticClickLogDataModule.from_config(CONFIG))
    traces = sorted((Path(out_dir) / f"rank{rank}").glob("*.json"))
    assert traces, f"rank {rank}: the profiler exported no trace into {out_dir}"
    names: set[str] = set()
    for trace in traces:
        names.update(event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"])
    return sorted(name for name in names if name.startswith("recsys:"))


def test_every_step_phase_label_is_in_a_2d_runs_trace(tmp_path: Path) -> None:
    results = run_ranks(_profiled_fit, 2, str(tmp_path), timeout=300, ranks_per_node=1)
    for rank, found in enumerate(results):
        missing = sorted(set(STEP_PHASES) - set(found))
        assert not missing, f"rank {rank}'s trace lacks {missing} (it has {found})"

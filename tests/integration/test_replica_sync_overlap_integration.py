"""Overlapped replica sync and bf16 deltas, 4 processes as 2 nodes x 2 (gloo): 2 replicas of sharding groups of 2.

The replica of rank r is rank r + 2 (groups {0, 1} and {2, 3}; replica groups {0, 2} and {1, 3}).
The model and batches are those of test_replica_sync_integration (a 1000-row table a batch barely
touches, a small one, and a sequence table), trained with row-wise Adagrad.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_recsys.testing.oracle.click import CONFIG, make_model, shards_of
from lightning_recsys.testing.processes import run_ranks
from test_replica_sync_integration import PER_NODE, WORLD, batch, build

from lightning_recsys import DCPCheckpointIO, EmbeddingOptimizerConfig, PlanningConfig, ReplicaSyncConfig, TwoDRecStrategy
from lightning_recsys.data import SyntheticClickLogDataModule

pytestmark = pytest.mark.slow
STEPS = 7
PARTNER = {0: 2, 1: 3, 2: 0, 3: 1}
# bf16 deltas against fp32 sync after STEPS steps of row-wise Adagrad at lr 0.3 (updates of about lr per
# step): bf16 keeps 8 bits, so each sync rounds a change of ~0.3 by up to ~1e-3 (measured: 2.5e-3 at most).
BF16_ATOL = 1e-2
# fp8 e4m3 keeps 3 mantissa bits: each sync rounds a change by up to 1/16 of its row's largest change.
FP8_ATOL = 6e-2


def _record(rank: int, world: int, configs: dict[str, ReplicaSyncConfig]) -> dict:
    """Per config and step: the state before and after ``step_ended`` and whether a sync was applied there."""
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    out: dict = {}
    for name, config in configs.items():
        run = build(rank, group_size=PER_NODE, sharding_type="row_wise", optimizer="rowwise_adagrad", sync=config)
        steps = []
        for step in range(STEPS):
            bags, seqs, labels = batch(step, rank)
            F.binary_cross_entropy_with_logits(run.sharded.dmp(bags, seqs), labels).backward()
            run.dense.step()
            run.dense.zero_grad(set_to_none=True)
            was_in_flight = run.sync.in_flight
            pre = run.state()
            run.sync.step_ended()
            synced = run.sync.steps_since_sync == 0
            steps.append({"pre": pre, "post": run.state(), "applied": was_in_flight and synced, "in_flight": run.sync.in_flight,
                          "synced": synced})
        in_flight_at_end = run.sync.in_flight
        run.sync.sync_if_pending()  # a forced sync (validation, save, train end): drains the one in flight
        out[name] = {"steps": steps, "end": run.state(), "in_flight_at_end": in_flight_at_end,
                     "in_flight_after_force": run.sync.in_flight, "stats": run.sync.last_sync_stats}
        run.sync.close()
    return out


OVERLAP = {
    "overlap-fp32": ReplicaSyncConfig(every_n_steps=1, overlap=True),
    "overlap-bf16-every-2": ReplicaSyncConfig(every_n_steps=2, overlap=True, precision="bf16"),
    "overlap-fp32-every-3": ReplicaSyncConfig(every_n_steps=3, overlap=True),
    "gather-overlap-fp32-every-2": ReplicaSyncConfig(every_n_steps=2, overlap=True, exchange="all_gather"),
    "gather-overlap-fp8-every-3": ReplicaSyncConfig(every_n_steps=3, overlap=True, precision="fp8", exchange="all_gather"),
}


def test_overlapped_sync_keeps_in_flight_updates_and_leaves_replicas_identical():
    results = run_ranks(_record, WORLD, OVERLAP, timeout=400, ranks_per_node=PER_NODE)
    for name, config in OVERLAP.items():
        every = config.every_n_steps
        kept = 0
        for rank in range(WORLD):
            mine, theirs = results[rank][name], results[PARTNER[rank]][name]
            launched = [j for j, s in enumerate(mine["steps"]) if s["synced"]]
            assert launched == list(range(every - 1, STEPS, every)), (name, rank)
            for j in range(STEPS):
                now = mine["steps"][j]
                assert now["in_flight"] == (j >= launched[0]), (name, rank, j)  # from the first sync on, one is in flight
                # A sync is applied exactly at the end of its interval, just before the next one is launched.
                assert now["applied"] == (j in launched and j != launched[0]), (name, rank, j)
                if not now["applied"]:
                    continue
                at_launch, other_at_launch = mine["steps"][j - every]["post"], theirs["steps"][j - every]["post"]
                other_now = theirs["steps"][j]
                for key, post in now["post"].items():
                    sent, other_sent = at_launch[key], other_at_launch[key]
                    drift = now["pre"][key] - sent  # what this replica changed while the sync was in flight
                    # The reference: the replicas' average of what was sent, plus this replica's own updates since.
                    exact = config.precision == "fp32"
                    if exact:
                        torch.testing.assert_close(post, (sent + other_sent) / 2 + drift, rtol=1e-5, atol=1e-6, msg=f"{name} {rank} {j} {key}")
                    # Rows neither replica changed in flight are bit-identical after the apply.
                    still = (now["pre"][key] == sent) & (other_now["pre"][key] == other_sent)
                    assert torch.equal(post[still], other_now["post"][key][still]), (name, rank, j, key)
                    # Rows changed in flight keep the change: post - average == drift, and it is not tiny.
                    moved = drift.abs() > 1e-3
                    kept += int(moved.sum())
                    if exact and bool(moved.any()):
                        average = (sent + other_sent) / 2
                        torch.testing.assert_close((post - average)[moved], drift[moved], rtol=1e-4, atol=1e-5)
            assert sum(s["applied"] for s in mine["steps"]) == len(launched) - 1 >= 1, (name, rank)
            # A forced sync drains the sync in flight, then every replica holds the same values everywhere.
            assert mine["in_flight_at_end"], (name, rank)  # the last sync launched is applied by the forced one
            assert not mine["in_flight_after_force"]
            for key, value in mine["end"].items():
                assert torch.equal(value, theirs["end"][key]), (name, rank, key)
        assert kept > 0, f"{name}: no row changed while its sync was in flight; the test would not see a lost update"


COMPRESSED = {  # name: (config, how far from the fp32 sync it may end)
    "bf16": (ReplicaSyncConfig(every_n_steps=2, precision="bf16"), BF16_ATOL),
    "fp8-all-gather": (ReplicaSyncConfig(every_n_steps=2, precision="fp8", exchange="all_gather"), FP8_ATOL),
}


def test_compressed_deltas_keep_replicas_bit_identical_and_close_to_fp32_sync():
    configs = {"fp32": ReplicaSyncConfig(every_n_steps=2), **{name: config for name, (config, _) in COMPRESSED.items()}}
    results = run_ranks(_record, WORLD, configs, timeout=400, ranks_per_node=PER_NODE)
    for name, (_, atol) in COMPRESSED.items():
        for rank in range(WORLD):
            mine, theirs = results[rank][name], results[PARTNER[rank]][name]
            synced_steps = [j for j, s in enumerate(mine["steps"]) if s["synced"]]
            assert synced_steps == list(range(1, STEPS, 2))
            for j in synced_steps:
                for key, value in mine["steps"][j]["post"].items():
                    assert torch.equal(value, theirs["steps"][j]["post"][key]), (name, rank, j, key)
            largest = 0.0
            for key, value in mine["end"].items():
                assert torch.equal(value, theirs["end"][key]), (name, rank, key)
                reference = results[rank]["fp32"]["end"][key]
                torch.testing.assert_close(value, reference, rtol=0, atol=atol, msg=f"{name} rank {rank} {key}")
                largest = max(largest, float((value - reference).abs().max()))
            print(f"{name} rank {rank}: largest |{name} - fp32| = {largest:.2e}")
            assert largest > 0, f"{name} deltas gave exactly the fp32 result: the compressed path did not run"


# ----------------------------------------------------------------- through Lightning: save/resume, a dead rank
STEPS_PER_EPOCH = 3  # every_n_steps=2: the epoch-end save at step 3 is mid-interval, with a sync in flight
SYNC = ReplicaSyncConfig(every_n_steps=2, overlap=True, precision="bf16")
GATHER_SYNC = ReplicaSyncConfig(every_n_steps=2, overlap=True, precision="fp8", exchange="all_gather")
# Each replica keeps its own Adagrad state; a checkpoint holds one. Before, it held the first replica's and the
# other replicas resumed from a state they never had (their tables ended 0.18 away from the uninterrupted run's).
OWN_STATE_SYNC = ReplicaSyncConfig(every_n_steps=2, optimizer_state=False)
PG_TIMEOUT = 20


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append((trainer.global_step, float(outputs["loss"])))


def _strategy(sync: ReplicaSyncConfig, **kwargs) -> TwoDRecStrategy:
    return TwoDRecStrategy(
        embedding_optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1), planning=PlanningConfig(sharding_types=["row_wise", "table_wise"]),
        sharding_group_size=PER_NODE, replica_sync=sync, **kwargs,
    )


def _fit(rank: int, world: int, ckpt_dir: str, max_epochs: int, ckpt_path: str | None, sync: ReplicaSyncConfig = SYNC) -> dict:
    losses = _Losses()
    trainer = Trainer(
        accelerator="cpu", devices=PER_NODE, num_nodes=world // PER_NODE, max_epochs=max_epochs, limit_val_batches=0,
        strategy=_strategy(sync, process_group_timeout=60, checkpoint_io=DCPCheckpointIO()),
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=-1), losses],
    )
    model = make_model()
    # Dense frozen: with 4 ranks DDP's ring sums gradients in bucket-dependent order, and DDP rebuilds its
    # buckets after the first iteration (torch/nn/parallel/distributed.py, _rebuild_buckets), which after
    # a resume is a later step: the dense part then differs in the last bit. The tables are what is tested.
    model.dense_lr = 0.0
    trainer.fit(model, datamodule=SyntheticClickLogDataModule.from_config(dataclasses.replace(CONFIG, train_batches=STEPS_PER_EPOCH)), ckpt_path=ckpt_path)
    return {"losses": losses.losses, "shards": shards_of(model)}


@pytest.mark.parametrize("sync", [SYNC, GATHER_SYNC, OWN_STATE_SYNC], ids=["all-reduce-bf16", "all-gather-fp8", "optimizer-state-not-synced"])
def test_checkpoint_saved_mid_interval_with_a_sync_in_flight_resumes_exactly(tmp_path, sync):
    full = run_ranks(_fit, WORLD, str(tmp_path / "full"), 2, None, sync, timeout=300, ranks_per_node=PER_NODE)
    run_ranks(_fit, WORLD, str(tmp_path / "resumed"), 1, None, sync, timeout=300, ranks_per_node=PER_NODE)
    resumed = run_ranks(_fit, WORLD, str(tmp_path / "resumed"), 2, "last", sync, timeout=300, ranks_per_node=PER_NODE)
    for rank in range(WORLD):
        assert resumed[rank]["losses"] == full[rank]["losses"][STEPS_PER_EPOCH:], rank
        for key, pieces in full[rank]["shards"].items():
            for (offsets, expected), (resumed_offsets, actual) in zip(pieces, resumed[rank]["shards"][key]):
                assert offsets == resumed_offsets and torch.equal(actual, expected), f"rank {rank}: {key}"


class _KillRank(Callback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # The step's optimizer hook has launched its overlapped sync already: it is in flight now.
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            assert trainer.strategy.runtime.replica_sync.in_flight
            os.kill(os.getpid(), signal.SIGKILL)


def _until_rank_1_dies(rank: int, world: int, sync: ReplicaSyncConfig, kill_step: int) -> None:
    trainer = Trainer(
        accelerator="cpu", devices=PER_NODE, num_nodes=world // PER_NODE, max_steps=100, max_epochs=1, limit_val_batches=0,
        strategy=_strategy(sync, process_group_timeout=PG_TIMEOUT),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[_KillRank(1, kill_step)],
    )
    trainer.fit(make_model(), datamodule=SyntheticClickLogDataModule.from_config(dataclasses.replace(CONFIG, train_batches=50)))


@pytest.mark.parametrize(
    ("sync", "kill_step"),
    # The deferred all-gather dies with only its counts' all-gather started (the changes' would start a step later).
    [(ReplicaSyncConfig(overlap=True), 3), (GATHER_SYNC, 2)], ids=["all-reduce", "deferred-all-gather"],
)
def test_a_rank_dying_with_a_sync_in_flight_stops_every_rank_within_the_timeout(sync, kill_step):
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_until_rank_1_dies, WORLD, sync, kill_step, timeout=PG_TIMEOUT + 120, grace_after_failure=PG_TIMEOUT + 30, ranks_per_node=PER_NODE)
    elapsed = time.monotonic() - start
    message = str(failed.value)
    assert "rank 1 died without a result (exit code -9)" in message, message[-3000:]
    for rank in (0, 2, 3):
        assert f"rank {rank} failed" in message, message[-3000:]  # raised on its own, not killed by the harness
    assert elapsed < PG_TIMEOUT + 30 + 60, f"took {elapsed:.0f}s"

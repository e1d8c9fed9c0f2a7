"""Failure behaviour with real processes (gloo): bad ids, uneven and empty batches, NaN, a dead rank, a soak."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning_recsys.testing.oracle.click import CONFIG, make_model, sgd_strategy
from lightning_recsys.testing.processes import run_ranks
from torch.utils.data import DataLoader, IterableDataset
from torchrec import KeyedJaggedTensor

from lightning_recsys import TwoDRecStrategy
from lightning_recsys.checkpoint import is_committed
from lightning_recsys.data import RecBatch, SyntheticClickLog, slice_batch
from lightning_recsys.parallel.input.batch_check import InputValidator
from lightning_recsys.strategies import sharding as strategy_sharding

PG_TIMEOUT = 20


class _PerRankBatches(IterableDataset):
    """Rank r yields ``counts[r]`` slices of the oracle's global batches, each passed through ``edit``."""

    def __init__(self, rank: int, world: int, counts: list[int], edit: Callable[[int, int, RecBatch], RecBatch]) -> None:
        self.rank, self.world, self.counts, self.edit = rank, world, counts, edit

    def __iter__(self):
        log, local = SyntheticClickLog(CONFIG), CONFIG.global_batch_size // self.world
        for i in range(self.counts[self.rank]):
            batch = slice_batch(log.global_batch("train", i % CONFIG.train_batches), self.rank * local, (self.rank + 1) * local)
            yield self.edit(self.rank, i, batch)


class _DataModule(LightningDataModule):
    def __init__(self, counts: list[int], edit: Callable[[int, int, RecBatch], RecBatch] = lambda r, i, b: b) -> None:
        super().__init__()
        self.counts, self.edit = counts, edit

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_PerRankBatches(self.trainer.global_rank, self.trainer.world_size, self.counts, self.edit), batch_size=None)


def _fit(world_size: int, data: LightningDataModule, strategy: TwoDRecStrategy, max_steps: int = 100, **trainer_kwargs) -> Trainer:
    trainer = Trainer(
        accelerator="cpu", devices=trainer_kwargs.pop("devices", world_size), strategy=strategy, max_steps=max_steps,
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(make_model(), datamodule=data)
    return trainer


# ----------------------------------------------------------------- a bad id on one rank
def _bad_id_on_rank_1(rank: int, world_size: int) -> None:
    def edit(r: int, i: int, batch: RecBatch) -> RecBatch:
        if r == 1 and i == 2:
            batch.sparse.values()[0] = 10_000
        return batch

    _fit(world_size, _DataModule([5, 5], edit), sgd_strategy(sharding_types=["table_wise"], process_group_timeout=PG_TIMEOUT))


def test_out_of_range_id_on_one_rank_stops_every_rank_with_the_culprit():
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_bad_id_on_rank_1, 2, timeout=120, grace_after_failure=PG_TIMEOUT + 30)
    message = str(failed.value)
    for rank in (0, 1):
        assert f"rank {rank} failed" in message and "InvalidInputError" in message
    assert "rank 1: batch 2: feature 'sparse_0' has id 10000 at example 0, but table 't_sparse_0' has 40 rows" in message
    assert time.monotonic() - start < 120


# ----------------------------------------------------------------- duplicate keys, a check that raises
def _duplicate_keys_on_rank_1(r: int, i: int, batch: RecBatch) -> RecBatch:
    """Rank 1's batch 2 gets sparse_0's block twice: every feature is there, one of them twice."""
    if r != 1 or i != 2:
        return batch
    kjt, first = batch.sparse, batch.sparse["sparse_0"]
    batch.sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=[*kjt.keys(), "sparse_0"], values=torch.cat([kjt.values(), first.values()]),
        lengths=torch.cat([kjt.lengths(), first.lengths()]),
    )
    return batch


class _CheckRaisesOnRank1(InputValidator):
    """A check with a bug that only rank 1's batch 2 triggers."""

    def check(self, kjt, *, batch):
        self._fail(batch)
        return super().check(kjt, batch=batch)

    def problems(self, kjt, *, batch):
        self._fail(batch)
        return super().problems(kjt, batch=batch)

    @staticmethod
    def _fail(batch: int) -> None:
        if dist.get_rank() == 1 and batch == 2:
            raise IndexError("index 0 is out of bounds for dimension 0 with size 0")


def _loader_raises_on_rank_1(r: int, i: int, batch: RecBatch) -> RecBatch:
    if r == 1 and i == 2:
        raise OSError("corrupt shard part-00017")
    return batch


def _guarded_fit(rank: int, world_size: int, case: str) -> None:
    if case == "check raises":
        strategy_sharding.InputValidator = _CheckRaisesOnRank1  # the strategy builds its validator from this name
    edit = {"duplicate keys": _duplicate_keys_on_rank_1, "loader raises": _loader_raises_on_rank_1}.get(case, lambda r, i, b: b)
    # validate_inputs="warn" would go on after an out-of-range id, but not after these.
    strategy = sgd_strategy(sharding_types=["table_wise"], process_group_timeout=PG_TIMEOUT, validate_inputs="warn")
    _fit(world_size, _DataModule([5, 5], edit), strategy)


@pytest.mark.parametrize(("case", "expected"), [
    ("duplicate keys", "rank 1: batch 2: the KeyedJaggedTensor has duplicate key(s): 'sparse_0' at key positions [0, 3]"),
    ("check raises", "rank 1: batch 2: checking the batch raised IndexError: index 0 is out of bounds"),
])
def test_malformed_batch_on_one_rank_stops_every_rank_with_the_same_error(case, expected):
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_guarded_fit, 2, case, timeout=120, grace_after_failure=PG_TIMEOUT + 30)
    message = str(failed.value)
    for rank in (0, 1):
        assert f"rank {rank} failed" in message, message[-3000:]
    # Both ranks raised InvalidInputError with the same text, before any step ran on the bad batch.
    assert message.count("InvalidInputError: invalid sparse input") == 2, message[-3000:]
    assert message.count(expected) == 2, message[-3000:]
    assert message.count("stop training whatever validate_inputs says") == 2
    assert time.monotonic() - start < PG_TIMEOUT + 60, "a rank waited for the process group's timeout"


def test_dataloader_error_on_one_rank_stops_every_rank_at_once():
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_guarded_fit, 2, "loader raises", timeout=120, grace_after_failure=PG_TIMEOUT + 30)
    message = str(failed.value)
    rank_0, rank_1 = message.split("rank 1 failed")
    assert "InvalidInputError" in rank_0 and "rank 1: batch 2: the dataloader raised OSError: corrupt shard part-00017" in rank_0
    assert rank_1.strip().splitlines()[-1] == "OSError: corrupt shard part-00017"  # its own error, not a copy
    assert time.monotonic() - start < PG_TIMEOUT + 60, "rank 0 waited for the process group's timeout"


class _RaisesOnRank1(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and batch_idx == 2:
            raise ValueError("a bug in rank 1's step")


def _own_error_on_rank_1(rank: int, world_size: int, pipeline: str) -> tuple[str, float, str]:
    start = time.monotonic()
    try:
        _fit(world_size, _DataModule([6, 6]), sgd_strategy(pipeline=pipeline, process_group_timeout=PG_TIMEOUT), callbacks=[_RaisesOnRank1()])
    except Exception as error:  # noqa: BLE001 - what each rank saw, and when
        return type(error).__name__, time.monotonic() - start, "\n".join(getattr(error, "__notes__", []))
    return "no error", time.monotonic() - start, ""


@pytest.mark.parametrize("pipeline", ["sparse_dist", "off"])
def test_an_exception_in_one_ranks_step_fails_that_rank_at_once(pipeline):
    # The raising rank used to wait at teardown for the next batch's input distribution, which its
    # peer (stuck in the step's collectives) never joins: a hang for the whole process-group timeout.
    (error_0, _, notes_0), (error_1, seconds_1, _) = run_ranks(_own_error_on_rank_1, 2, pipeline, timeout=PG_TIMEOUT + 60)
    assert error_1 == "ValueError" and seconds_1 < PG_TIMEOUT / 2, (error_1, seconds_1)
    assert error_0 == "RuntimeError"  # its collective lost the peer
    # Rank 1 left its error on the store before it exited: rank 0 names it rather than "did not check in".
    expected = "TwoDRecStrategy: rank 0: rank(s) [1] stopped on their own error (rank 1: ValueError: a bug in rank 1's step)"
    assert notes_0.startswith(expected), notes_0


# ----------------------------------------------------------------- SIGTERM (preemption) on one rank
class _SigtermOnRank1(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def _sigterm_on_rank_1(rank: int, world_size: int) -> tuple[str, int, float, object]:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=sgd_strategy(process_group_timeout=PG_TIMEOUT), max_steps=100, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[_SigtermOnRank1()],
    )
    start = time.monotonic()
    try:
        trainer.fit(make_model(), datamodule=_DataModule([20, 20]))
    except SIGTERMException as stop:  # Lightning's stop on SIGTERM (a SystemExit)
        return "SIGTERMException", trainer.global_step, time.monotonic() - start, stop.code
    return "no stop", trainer.global_step, time.monotonic() - start, None


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step():
    # Lightning's handler broadcast from rank 0 inside the signal handler, on the signalled rank only:
    # its collectives then mismatched its peer's (a hang for process_group_timeout, or gloo aborting).
    results = run_ranks(_sigterm_on_rank_1, 2, timeout=PG_TIMEOUT + 60)
    assert [r[0] for r in results] == ["SIGTERMException"] * 2, results
    assert results[0][1] == results[1][1] < 20, results  # the same step, well before the epoch's end
    assert all(seconds < PG_TIMEOUT for _, _, seconds, _ in results), results
    assert [r[3] for r in results] == [143] * 2, results  # the exit status says the run was stopped (it was 0)


class _CountBroadcasts(Callback):
    """Counts ``torch.distributed.broadcast`` calls from the first training step's start to the last one's end."""

    def __init__(self) -> None:
        self.calls, self._original = 0, dist.broadcast

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            def counting(*args, **kwargs):
                self.calls += 1
                return self._original(*args, **kwargs)

            dist.broadcast = counting

    def on_train_end(self, trainer, pl_module) -> None:
        dist.broadcast = self._original


def _broadcasts_during_steps(rank: int, world_size: int) -> tuple[int, int]:
    counter = _CountBroadcasts()
    trainer = _fit(world_size, _DataModule([6, 6]), sgd_strategy(process_group_timeout=PG_TIMEOUT), callbacks=[counter])
    return counter.calls, trainer.global_step


def test_no_per_step_sigterm_broadcast_remains():
    # Lightning 2.6 broadcast rank 0's SIGTERM flag before every step (a blocking collective, a host-device
    # sync on CUDA); the batch handshake carries SIGTERM already (test above), so it is gone.
    assert run_ranks(_broadcasts_during_steps, 2, timeout=120) == [(0, 6), (0, 6)]


# ----------------------------------------------------------------- uneven and empty batches
def _uneven(rank: int, world_size: int, sharding_type: str) -> int:
    def edit(r: int, i: int, batch: RecBatch) -> RecBatch:
        return slice_batch(batch, 0, 0) if (r == 1 and i == 1) else batch  # an empty batch on rank 1

    trainer = _fit(world_size, _DataModule([5, 4], edit), sgd_strategy(sharding_types=[sharding_type], process_group_timeout=PG_TIMEOUT))
    return trainer.global_step


@pytest.mark.parametrize("sharding_type", ["table_wise", "row_wise"])
def test_uneven_and_empty_batches_neither_hang_nor_crash(sharding_type):
    # Rank 0 has 5 batches, rank 1 has 4 with an empty one: the empty step is skipped on both ranks,
    # and both stop when rank 1 runs out (rank 0's 5th batch is dropped).
    steps = run_ranks(_uneven, 2, sharding_type, timeout=120)
    assert steps == [3, 3]


# ----------------------------------------------------------------- a rank without evaluation batches
class _Sized:
    """A sized evaluation loader (a list of batches): Lightning checks its length on every rank."""

    def __init__(self, batches: list[RecBatch]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _validation_without_batches_on_rank_1(rank: int, world_size: int, allow_zero_length: bool) -> dict:
    local = CONFIG.global_batch_size // world_size
    val = _Sized([] if rank == 1 else [slice_batch(SyntheticClickLog(CONFIG).global_batch("val", 0), 0, local)])
    train = _Sized([slice_batch(SyntheticClickLog(CONFIG).global_batch("train", i), rank * local, (rank + 1) * local) for i in range(3)])
    model = make_model()
    model.allow_zero_length_dataloader_with_multiple_devices = allow_zero_length
    trainer = Trainer(
        accelerator="cpu", devices=world_size, strategy=sgd_strategy(process_group_timeout=PG_TIMEOUT), max_epochs=1,
        val_check_interval=2, num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    steps = trainer.global_step
    validated = trainer.validate(model, dataloaders=val, verbose=False)
    return {"steps": steps, "validated": validated}


@pytest.mark.parametrize("allow_zero_length", [False, True])
def test_a_rank_without_validation_batches_neither_hangs_nor_crashes(allow_zero_length):
    # Rank 1's sized validation loader is empty. Lightning raised "`CoordinatedBatches` within local rank has
    # zero length" on rank 1 alone; with allow_zero_length_dataloader_with_multiple_devices it skipped the
    # loop on rank 1 alone, and rank 0 waited in the batch handshake until process_group_timeout. Now every
    # rank runs the loop, learns in the first handshake that rank 1 has no batch, and stops there, as for
    # any uneven end (with its warning): no batch is evaluated, so no val/ metric is logged, and training goes on.
    results = run_ranks(_validation_without_batches_on_rank_1, 2, allow_zero_length, timeout=120)
    assert [r["steps"] for r in results] == [3, 3]
    assert [r["validated"] for r in results] == [[{}], [{}]]


# ----------------------------------------------------------------- NaN
def _nan_on_rank_1(rank: int, world_size: int) -> None:
    def edit(r: int, i: int, batch: RecBatch) -> RecBatch:
        if r == 1 and i == 2:
            batch.dense[0, 0] = float("nan")
        return batch

    _fit(world_size, _DataModule([5, 5], edit), sgd_strategy(check_finite=True, process_group_timeout=PG_TIMEOUT))


def test_non_finite_loss_stops_every_rank_with_the_step():
    with pytest.raises(AssertionError) as failed:
        run_ranks(_nan_on_rank_1, 2, timeout=120, grace_after_failure=PG_TIMEOUT + 30)
    message = str(failed.value)
    for rank in (0, 1):
        assert f"rank {rank} failed" in message
    assert message.count("FloatingPointError: TwoDRecStrategy(check_finite): non-finite values at step 2: the training loss on rank(s) [1]") == 2


# ----------------------------------------------------------------- a rank dies
class _KillRank(Callback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _train_until_rank_1_dies(rank: int, world_size: int, log_dir: str, group_size: int) -> None:
    import logging

    handler = logging.FileHandler(Path(log_dir) / f"rank{rank}.log")
    logging.getLogger("lightning_recsys").addHandler(handler)
    strategy = sgd_strategy(sharding_types=["table_wise"], sharding_group_size=group_size, process_group_timeout=PG_TIMEOUT)
    per_node = 2 if world_size == 4 else world_size
    _fit(world_size, _DataModule([50] * world_size), strategy, devices=per_node, num_nodes=world_size // per_node,
         callbacks=[_KillRank(1, 3)])


@pytest.mark.parametrize(("world_size", "group_size"), [(2, 2), (4, 2)], ids=["1d-2-ranks", "2d-2x2"])
def test_dead_rank_makes_every_other_rank_exit_within_the_timeout(world_size, group_size, tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(
            _train_until_rank_1_dies, world_size, str(tmp_path), group_size, timeout=PG_TIMEOUT + 120,
            grace_after_failure=PG_TIMEOUT + 30, ranks_per_node=2,
        )
    elapsed = time.monotonic() - start
    message = str(failed.value)
    assert "rank 1 died without a result (exit code -9)" in message
    survivors = [r for r in range(world_size) if r != 1]
    for rank in survivors:
        # Each survivor raised on its own (was not killed by the harness), within timeout + 30 s.
        assert f"rank {rank} failed" in message, message[-3000:]
    assert elapsed < PG_TIMEOUT + 30 + 60, f"took {elapsed:.0f}s"
    # Survivors check in on the rendezvous store and name the ranks that did not (a rank still stuck
    # in a collective is named too); once rank 0 has exited, the store is gone and its node's ranks are named unreachable.
    reports = {r: (tmp_path / f"rank{r}.log").read_text() for r in survivors}
    named = [re.search(r"lost rank\(s\) \[([\d, ]+)\]", text) for text in reports.values()]
    assert any(m and "1" in m.group(1).split(", ") for m in named), reports
    for rank, text in reports.items():
        assert "lost rank(s) [" in text or "unreachable rank(s) [0" in text, (rank, text)


# ----------------------------------------------------------------- soak
class _Rss(Callback):
    def __init__(self) -> None:
        self.samples: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % 100 == 0:
            pages = int(Path("/proc/self/statm").read_text().split()[1])
            self.samples[trainer.global_step] = pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _soak(rank: int, world_size: int, steps: int) -> dict[int, float]:
    rss = _Rss()
    # 2D: two replicas of one rank each, synced every step.
    _fit(world_size, _DataModule([steps] * world_size), sgd_strategy(sharding_group_size=1), max_steps=steps, callbacks=[rss])
    return rss.samples


def test_soak_2d_memory_stays_flat():
    steps = 2000
    results = run_ranks(_soak, 2, steps, timeout=600)
    for rank, samples in enumerate(results):
        warm, end = samples[200], samples[steps]
        print(f"soak rank {rank}: RSS {warm:.1f} MiB at step 200 -> {end:.1f} MiB at step {steps} ({(end / warm - 1) * 100:+.2f}%)")
        assert end < warm * 1.10, samples


# ----------------------------------------------------------------- SLURM auto-requeue (SIGUSR1)
def _fake_slurm(rank: int, world_size: int, tmp: Path) -> None:
    """srun's variables for one node of ``world_size`` tasks (Lightning then picks SLURMEnvironment, auto_requeue on),
    and a fake ``scontrol`` on PATH that logs its arguments."""
    bin_dir = tmp / "bin"
    os.environ.update(
        SLURM_JOB_ID="4242", SLURM_JOB_NAME="recsys-2d", SLURM_NTASKS=str(world_size), SLURM_NTASKS_PER_NODE=str(world_size),
        SLURM_NNODES="1", SLURM_NODELIST="localhost", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0",
        PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    if rank == 0:
        bin_dir.mkdir(exist_ok=True)
        script = bin_dir / "scontrol"
        script.write_text(f'#!/bin/sh\necho "$@" >> "{tmp}/scontrol.log"\n')
        script.chmod(0o755)


class _SignalAt(Callback):
    def __init__(self, ranks: tuple[int, ...], step: int, signum: int) -> None:
        self.ranks, self.step, self.signum = ranks, step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank in self.ranks and trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class _FirstStep(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def _requeue_signal(rank: int, world_size: int, tmp: str, ranks: tuple[int, ...]) -> tuple[str, int, float, int, int]:
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    _fake_slurm(rank, world_size, Path(tmp))

    def trainer(*callbacks: Callback) -> Trainer:
        return Trainer(
            accelerator="cpu", devices=world_size, strategy=sgd_strategy(process_group_timeout=PG_TIMEOUT), max_steps=100, max_epochs=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
            callbacks=list(callbacks),
        )

    first = trainer(_SignalAt(ranks, 2, signal.SIGUSR1))
    assert isinstance(first.strategy.cluster_environment, SLURMEnvironment) and first.strategy.cluster_environment.auto_requeue
    start, outcome = time.monotonic(), "no stop"
    try:
        first.fit(make_model(), datamodule=_DataModule([20, 20]))
    except SIGTERMException as stop:
        outcome = f"SIGTERMException({stop.code})"
    seconds = time.monotonic() - start
    # The requeued job: fit under SLURM resumes from the newest hpc_ckpt_N.ckpt in default_root_dir by itself.
    second = trainer(resumed := _FirstStep())
    second.fit(make_model(seed=99), datamodule=_DataModule([20, 20]))
    return outcome, first.global_step, seconds, resumed.step, second.global_step


@pytest.mark.parametrize("ranks", [(1,), (0, 1)], ids=["rank-1", "every-rank"])
def test_slurm_requeue_signal_saves_on_every_rank_requeues_once_and_stops_every_rank(ranks, tmp_path):
    # Lightning's handler saved the checkpoint inside the signal handler, on the signalled rank only: DCP's
    # collectives then mismatched its peer's (rank 1 of 2 signalled: both failed after process_group_timeout,
    # nothing saved, no requeue; every rank signalled: saved, but training went on to the epoch's end).
    results = run_ranks(_requeue_signal, 2, str(tmp_path), ranks, timeout=PG_TIMEOUT + 60)
    assert [r[0] for r in results] == ["SIGTERMException(143)"] * 2, results
    stopped = results[0][1]
    assert results[1][1] == stopped < 20, results  # the same step, well before the epoch's end
    assert all(r[2] < PG_TIMEOUT for r in results), results
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # rank 0 requeued, once
    assert is_committed(tmp_path / "hpc_ckpt_1.ckpt") and not (tmp_path / "hpc_ckpt_2.ckpt").exists()
    assert [r[3:] for r in results] == [(stopped, 20)] * 2, results  # the requeued run resumed at that step

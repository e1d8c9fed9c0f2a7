"""Preemption under TwoDRecStrategy: a SIGTERM or a SLURM requeue signal on any rank stops every rank after the same step."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from typing import Any, Optional

from lightning.pytorch import LightningModule, Trainer

log = logging.getLogger(__name__)

# What a rank asks for in the batch handshake (bit flags of its stop integer).
STOP = 1  # SIGTERM: stop
REQUEUE = 2  # SLURM's requeue signal (SIGUSR1): save the HPC checkpoint, requeue the job, stop
# The exit status of a run every rank stopped this way (Lightning's SIGTERMException is a SystemExit with no code: 0,
# which a scheduler's script cannot tell from a finished run); 128 + SIGTERM, as a process killed by SIGTERM reports.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class CoordinatedSigterm:
    """Replaces Lightning's SIGTERM notifier and SLURM requeue handler; the batch handshake carries the note to every rank."""

    global_rank: int
    launcher: Any
    lightning_module: Optional[LightningModule]
    _sigterm_pending: bool = False  # this rank got SIGTERM; told to the others in the next batch handshake
    _sigterm_agreed: bool = False  # every rank knows, and stops on the same step
    _requeue_pending: bool = False  # this rank got SLURM's requeue signal; told to the others likewise
    _requeue_agreed: bool = False  # every rank saves the HPC checkpoint at the stop, and rank 0 requeues

    def _coordinate_sigterm(self, trainer: Trainer) -> None:
        """Make a SIGTERM (preemption) or SLURM requeue signal stop every rank on the same step instead of hanging them.

        Lightning's own handler broadcasts from rank 0 inside the signal handler, wherever the rank
        is, and sets the stop flag on that rank only: its collectives then mismatch its peers' (a
        hang until ``process_group_timeout``, or gloo aborting). Here the handler only notes the
        signal; the next batch handshake tells every rank, which then sets Lightning's flag together,
        so Lightning raises ``SIGTERMException`` on every rank after the same step.
        """
        connector = getattr(trainer, "_signal_connector", None)
        if connector is None:  # a Lightning without the connector: leave its handling alone
            return
        self._sigterm_pending = self._sigterm_agreed = self._requeue_pending = self._requeue_agreed = False

        def note_sigterm(signum: int, frame: object) -> None:
            log.info("TwoDRecStrategy: rank %d received signal %d; every rank stops after the next agreed step", self.global_rank, signum)
            launcher = self.launcher
            if not self._sigterm_pending and launcher is not None:
                launcher.kill(signal.Signals(signum))  # as Lightning does: pass it on to the processes this one started
            self._sigterm_pending = True

        def note_requeue(signum: int, frame: object) -> None:
            log.info("TwoDRecStrategy: rank %d received SLURM's requeue signal %d; every rank saves, rank 0 requeues, all stop", self.global_rank, signum)
            self._requeue_pending = True

        # register_signal_handlers (after strategy.setup) installs connector._sigterm_notifier_fn, and under
        # SLURMEnvironment(auto_requeue=True) connector._slurm_sigusr_handler_fn for its requeue signal.
        connector._sigterm_notifier_fn = note_sigterm
        # Workaround: Lightning 2.6's _SignalConnector._slurm_sigusr_handler_fn calls trainer.save_checkpoint inside the
        # handler on the signalled rank only (trainer/connectors/signal_connector.py): DCP's collective save mismatches.
        connector._slurm_sigusr_handler_fn = note_requeue
        # Workaround: Lightning 2.6's _TrainingEpochLoop.advance broadcasts rank 0's SIGTERM flag and reads it with
        # .item() before every step (loops/training_epoch_loop.py, _broadcast_sigterm_tensor): a blocking collective and,
        # on CUDA, a host-device sync per step. Here the handshake sets the flag on every rank at the same step already,
        # and the loop raises SIGTERMException at that step's end (on_advance_end), so the broadcast is redundant.
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            epoch_loop._broadcast_sigterm_tensor = _flag_set_by_the_handshake

    def _stop_requests(self) -> int:
        """This rank's stop integer for the batch handshake (bit flags: STOP, REQUEUE)."""
        return (STOP if self._sigterm_pending else 0) | (REQUEUE if self._requeue_pending else 0)

    def _stop_on_every_rank(self, ranks: list[int], requests: int) -> None:
        if self._sigterm_agreed:
            return
        self._sigterm_agreed = True
        self._requeue_agreed = bool(requests & REQUEUE)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            trainer._signal_connector.received_sigterm = True
        if self.global_rank == min(ranks):
            what = "SLURM requeue signal" if self._requeue_agreed else "SIGTERM"
            log.warning("TwoDRecStrategy: %s on rank(s) %s: every rank stops after this step", what, ranks)

    def _save_and_requeue(self, trainer: Trainer) -> None:
        """At the agreed stop, on every rank: what Lightning's SLURM requeue handler does, collectively.

        Upstream (``_SignalConnector._slurm_sigusr_handler_fn``): save to ``hpc_save_path(default_root_dir)``
        (``fit`` under SLURM resumes from the newest ``hpc_ckpt_N.ckpt`` there), then rank 0 runs
        ``scontrol requeue <job id>``.
        """
        self._requeue_agreed = False  # once
        path = trainer.strategy.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir), src=0)
        trainer.save_checkpoint(path)  # collective: every rank is at the same step
        if self.global_rank != 0:
            return
        array_job_id = os.environ.get("SLURM_ARRAY_JOB_ID")
        job_id = f"{array_job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job_id is not None else os.environ["SLURM_JOB_ID"]
        assert re.match("[0-9_-]+", job_id)
        try:
            result = subprocess.call(["scontrol", "requeue", job_id])
        except FileNotFoundError:  # as Lightning does: try again through a shell
            result = subprocess.call(f"scontrol requeue {job_id}", shell=True)
        if result == 0:
            log.warning("TwoDRecStrategy: saved %s and requeued SLURM job %s", path, job_id)
        else:
            log.warning("TwoDRecStrategy: saved %s; requeuing SLURM job %s failed with exit code %d", path, job_id, result)


def _flag_set_by_the_handshake() -> None:
    """Stands in for Lightning's per-step SIGTERM broadcast: the batch handshake already agreed the flag on every rank."""

"""Preemption under TwoDRecStrategy: a SIGTERM on any rank stops every rank after the same step."""

from __future__ import annotations

import logging
import signal
from typing import Any, Optional

from lightning.pytorch import LightningModule, Trainer

log = logging.getLogger(__name__)


class CoordinatedSigterm:
    """Replaces Lightning's SIGTERM notifier; the batch handshake carries the note to every rank."""

    global_rank: int
    launcher: Any
    lightning_module: Optional[LightningModule]
    _sigterm_pending: bool = False  # this rank got SIGTERM; told to the others in the next batch handshake
    _sigterm_agreed: bool = False  # every rank knows, and stops on the same step

    def _coordinate_sigterm(self, trainer: Trainer) -> None:
        """Make a SIGTERM (preemption) stop every rank on the same step instead of hanging them.

        Lightning's own handler broadcasts from rank 0 inside the signal handler, wherever the rank
        is, and sets the stop flag on that rank only: its collectives then mismatch its peers' (a
        hang until ``process_group_timeout``, or gloo aborting). Here the handler only notes the
        signal; the next batch handshake tells every rank, which then sets Lightning's flag together,
        so Lightning raises ``SIGTERMException`` on every rank after the same step.
        """
        connector = getattr(trainer, "_signal_connector", None)
        if connector is None:  # a Lightning without the connector: leave its handling alone
            return
        self._sigterm_pending = self._sigterm_agreed = False

        def note_sigterm(signum: int, frame: object) -> None:
            log.info("TwoDRecStrategy: rank %d received signal %d; every rank stops after the next agreed step", self.global_rank, signum)
            launcher = self.launcher
            if not self._sigterm_pending and launcher is not None:
                launcher.kill(signal.Signals(signum))  # as Lightning does: pass it on to the processes this one started
            self._sigterm_pending = True

        # register_signal_handlers (after strategy.setup) installs connector._sigterm_notifier_fn.
        connector._sigterm_notifier_fn = note_sigterm

    def _stop_on_every_rank(self, ranks: list[int]) -> None:
        if self._sigterm_agreed:
            return
        self._sigterm_agreed = True
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            trainer._signal_connector.received_sigterm = True
        if self.global_rank == min(ranks):
            log.warning("TwoDRecStrategy: SIGTERM on rank(s) %s: every rank stops after this step", ranks)

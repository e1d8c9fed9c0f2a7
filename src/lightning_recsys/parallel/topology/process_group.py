"""Process-group plumbing that every entry point needs: a store per torchrun restart, failure diagnosis, a clean exit. No Lightning."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

_RAISED_ON_EVERY_RANK = "_lightning_recsys_raised_on_every_rank"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
USE_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def raised_on_every_rank(error: BaseException) -> BaseException:
    """Mark ``error`` as raised by every rank at the same point (a coordinated stop); returns it.

    Teardown may then still finish the collectives every rank started; after any other error this
    rank failed alone and its peers are elsewhere, so waiting for them would hang until the timeout."""
    setattr(error, _RAISED_ON_EVERY_RANK, True)
    return error


def was_raised_on_every_rank(error: BaseException) -> bool:
    return bool(getattr(error, _RAISED_ON_EVERY_RANK, False))


def looks_like_lost_peer(exception: BaseException) -> bool:
    """Whether a collective's error reads like a peer that died or hung (worth asking who is gone)."""
    text = str(exception).lower()
    return isinstance(exception, (RuntimeError, dist.DistError)) and any(
        hint in text for hint in ("connection closed", "connection reset", "timed out", "timeout", "broken pipe", "nccl")
    )


_SURVIVOR_KEY = "lightning_recsys/survivor/{rank}"
_OWN_ERROR_KEY = "lightning_recsys/own_error/{rank}"


def report_own_error(rank: int, error: BaseException, *, wait_seconds: float = 2.0) -> None:
    """Leave this rank's own error on the rendezvous store before it exits, so that a peer whose collective
    then fails names it (``report_lost_ranks``) instead of waiting for this rank to check in."""
    summary = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"[:300]

    def record() -> None:
        try:
            dist.distributed_c10d._get_default_store().set(_OWN_ERROR_KEY.format(rank=rank), summary)
        except Exception:  # noqa: BLE001, S110 - best effort: the rank's own error propagates either way
            pass

    # In a thread for the reason check_in is: a store whose host is gone can block a call with no deadline.
    thread = threading.Thread(target=record, name="lightning_recsys-own-error", daemon=True)
    thread.start()
    thread.join(wait_seconds)


def report_lost_ranks(
    rank: int, world_size: int, *, wait_seconds: float, store_host_ranks: Sequence[int] = (0,),
    stop_early: Callable[[], bool] | None = None,
) -> str:
    """After a failed collective: which ranks are gone? Survivors check in on the rendezvous store.

    Every surviving rank writes a key and waits up to ``wait_seconds`` for the others'; a rank
    that never checks in is reported lost (dead, stuck in a collective, or cut off by the network).
    A rank that stopped on its own error and said so (``report_own_error``) is named with that error,
    without a wait for it.
    If the store itself does not answer within ``wait_seconds``, the ranks of its host's node
    (``store_host_ranks``: torchrun's node 0) are the ones this rank cannot reach. The wait ends
    early once ``stop_early()`` is true (the launcher is stopping this rank: waiting longer would only
    delay its restart).
    """
    outcome: dict[str, Any] = {}
    started = time.monotonic()

    def stopped() -> bool:
        return stop_early is not None and stop_early()

    def check_in() -> None:
        # torch keeps the store of init_process_group private; it is the only channel left once a rank is gone.
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(_SURVIVOR_KEY.format(rank=rank), "1")
            deadline = time.monotonic() + wait_seconds
            own_errors: dict[int, str] = {}

            def still_missing(ranks: list[int]) -> list[int]:
                missing = []
                for r in ranks:
                    if store.check([_OWN_ERROR_KEY.format(rank=r)]):
                        own_errors[r] = store.get(_OWN_ERROR_KEY.format(rank=r)).decode(errors="replace")
                    elif not store.check([_SURVIVOR_KEY.format(rank=r)]):
                        missing.append(r)
                return missing

            missing = still_missing(list(range(world_size)))
            while missing and time.monotonic() < deadline and not stopped():
                time.sleep(0.2)
                missing = still_missing(missing)
            outcome["missing"], outcome["own_errors"] = missing, own_errors
        except Exception as error:  # noqa: BLE001 - this is a diagnosis; the original error propagates
            outcome["error"] = error

    # A store call can block until the link is back while the store's host is unreachable (TCPStore's
    # client reads a reply with no deadline, e.g. after a timed-out wait: TCPStore::doWait in torch 2.13),
    # so the check-in runs in a daemon thread and this rank stops waiting for it after wait_seconds.
    thread = threading.Thread(target=check_in, name="lightning_recsys-check-in", daemon=True)
    thread.start()
    deadline = time.monotonic() + wait_seconds + 1.0
    while thread.is_alive() and time.monotonic() < deadline and not stopped():
        thread.join(0.1)
    thread.join(0.5)  # a stop: let the check-in finish its round
    if "missing" not in outcome:
        hosts = [r for r in store_host_ranks if r != rank] or list(store_host_ranks)
        error = outcome.get("error")
        why = (str(error).splitlines() or [type(error).__name__])[0] if error is not None else "no answer"
        return (
            f"unreachable rank(s) {hosts}: the rendezvous store on their node (with rank 0) did not answer within "
            f"{min(wait_seconds, time.monotonic() - started):.0f}s ({why}); that node, or the network link to it, is lost"
        )
    missing, own_errors = outcome["missing"], outcome["own_errors"]
    failed = sorted(r for r in own_errors if r != rank)
    parts = []
    if failed:
        errors = "; ".join(f"rank {r}: {own_errors[r]}" for r in failed)
        parts.append(f"rank(s) {failed} stopped on their own error ({errors}); see their output for the traceback")
    if missing:
        within = (
            f"by the time the launcher stopped this rank, {time.monotonic() - started:.1f}s after the failure"
            if stopped() else f"within {wait_seconds:.0f}s of the failure"
        )  # fmt: skip
        parts.append(f"lost rank(s) {missing}: they did not check in {within} (dead, stuck in a collective, or cut off by the network)")
    return "; ".join(parts) or "every rank is still alive; the failure is not a lost rank (see the other ranks' errors)"


def diagnose_failure(
    rank: int, world_size: int, error: BaseException, *, wait_seconds: float, store_host_ranks: Sequence[int] = (0,),
    stop_early: Callable[[], bool] | None = None,
) -> Optional[str]:
    """What this rank's ``error`` says about its peers, from the rendezvous store; None when there is nothing to say.

    A failed collective (``looks_like_lost_peer``): which ranks are lost, and which stopped on their own
    error (``report_lost_ranks``). Any other error that only this rank raised: left on the store for the
    peers (``report_own_error``), whose collectives fail once this rank exits."""
    if looks_like_lost_peer(error):
        return report_lost_ranks(rank, world_size, wait_seconds=wait_seconds, store_host_ranks=store_host_ranks, stop_early=stop_early)
    if not was_raised_on_every_rank(error):
        report_own_error(rank, error)
    return None


def destroy_process_group_at_exit() -> None:
    """An ``atexit`` handler: destroy the default process group, then free what still holds its groups."""
    # Workaround: torch 2.13 aborts at interpreter exit ("terminate called without an active
    # exception", SIGABRT) when the default process group is never destroyed.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # The Trainer, strategy and DMP reference each other, so their process groups would otherwise be
    # freed by the collector during interpreter finalization, where gloo's worker threads releasing
    # tensors can no longer take the GIL (the SIGABRT above). Free them now, while Python is whole.
    gc.collect()


def restart_attempt() -> Optional[int]:
    """torchrun's restart attempt of this worker (0 at the first start), or None outside torchrun."""
    value = os.environ.get(RESTART_COUNT_ENV)
    return int(value) if value is not None and value.isdigit() else None


def attempt_scoped_store(
    main_address: str, main_port: int, *, rank: int, world_size: int, timeout: timedelta
) -> Optional[dist.Store]:
    """A store for ``init_process_group`` whose keys belong to this restart attempt alone; None outside torchrun.

    Workaround (torch 2.13): under torchrun the workers share the agent's TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE``), and ``_create_c10d_store`` in torch/distributed/rendezvous.py
    hands it out unprefixed, assuming "a new TCPStore for every retry". The agents keep one store
    for the whole job (``StaticTCPRendezvous.next_rendezvous`` creates it once; the c10d
    rendezvous's shared server is made at the first round only), so a restarted rank can read the
    previous attempt's keys: gloo's ``connectFullMesh`` then dials a dead rank's old address and
    times out (compare pytorch/pytorch issue #135712, where the per-attempt prefix was removed).
    The attempt number is the same on every rank when every restart follows a failure on every
    node, which a lost peer causes (a collective on the survivors fails).
    """
    attempt = restart_attempt()
    if attempt is None or os.environ.get(USE_AGENT_STORE_ENV) != str(True):
        return None  # not torchrun's shared store: each start gets a fresh store
    url = f"tcp://{main_address}:{main_port}"
    store, _, _ = next(dist.rendezvous(url, rank=rank, world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"lightning_recsys/restart_attempt_{attempt}/", store)

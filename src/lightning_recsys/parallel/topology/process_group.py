"""Process-group plumbing that every entry point needs: failure diagnosis and a clean exit. No Lightning."""

from __future__ import annotations

import gc
import time

import torch.distributed as dist

_RAISED_ON_EVERY_RANK = "_lightning_recsys_raised_on_every_rank"


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


def report_lost_ranks(rank: int, world_size: int, *, wait_seconds: float) -> str:
    """After a failed collective: which ranks are gone? Survivors check in on the rendezvous store.

    Every surviving rank writes a key and waits up to ``wait_seconds`` for the others'; a rank
    that never checks in is reported lost (dead, or stuck in a collective). If the store itself is
    unreachable, its host (rank 0's node) is the one lost.
    """
    # torch keeps the store of init_process_group private; it is the only channel left once a rank is gone.
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"lightning_recsys/survivor/{rank}", "1")
        deadline = time.monotonic() + wait_seconds
        missing = list(range(world_size))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"lightning_recsys/survivor/{r}"])]
            time.sleep(0.2)
    except Exception as error:  # noqa: BLE001 - this is a diagnosis; the original error propagates
        return f"the rendezvous store (hosted with rank 0) is unreachable ({error}); rank 0 is probably lost"
    if not missing:
        return "every rank is still alive; the failure is not a lost rank (see the other ranks' errors)"
    return f"lost rank(s) {missing}: they did not check in within {wait_seconds:.0f}s of the failure (dead, or stuck in a collective)"


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

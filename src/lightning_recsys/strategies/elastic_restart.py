"""The process group's store under torchrun restarts: one key space per restart attempt."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
USE_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


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

"""The multi-process harness fails fast, naming the rank, instead of hanging on a dead rank."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning_recsys.testing.processes import run_ranks


def _rank_one_dies(rank: int, world_size: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=20))
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))  # rank 0 would wait here forever without timeouts


def test_dead_rank_fails_fast_with_its_rank():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 died without a result \(exit code 3\)"):
        run_ranks(_rank_one_dies, 2, timeout=60)
    assert time.monotonic() - start < 60

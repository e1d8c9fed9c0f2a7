"""An overlapped all-reduce sync started in shares (``InFlightSync(pieces=...)``), 2 processes (gloo).

The shares must start one per ``progress()`` and, applied, give the same bits as one launch.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys.parallel.sync import sync_deltas
from lightning_recsys.parallel.sync.sync_deltas import InFlightSync, SyncItem, whole_tensor_items

pytestmark = pytest.mark.slow


def _tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(300, 8, generator=g), torch.rand(300, generator=g)]


def _sync(rank: int, world: int, pieces: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    sync_deltas.MIN_PIECE_BYTES = 1024  # these tensors are about 10 KB: let them split
    tensors = _tensors(rank)
    rows = torch.arange(0, 300, 3)
    items = [SyncItem(tensors[0], rows, None)] + whole_tensor_items([tensors[1]])
    sync = InFlightSync(items, dist.group.WORLD, world, bucket_bytes=2048, async_op=True, pieces=pieces)
    started = [sync.shares_started]
    for _ in range(pieces - 1):
        tensors[1].add_(0.5)  # a step meanwhile: kept on top of the average
        sync.progress()
        started.append(sync.shares_started)
    sync.apply()
    return {"started": started, "after": [t.clone() for t in tensors], "payload": sync.payload_bytes}


def test_an_overlapped_sync_in_shares_starts_one_per_progress_and_writes_the_same_bits():
    one = run_ranks(_sync, 2, 1, timeout=120)
    four = run_ranks(_sync, 2, 4, timeout=120)
    for rank in range(2):
        assert four[rank]["started"] == [1, 2, 3, 4], four[rank]["started"]
        assert four[rank]["payload"] == one[rank]["payload"]
        # The second tensor changed three times more before the apply in the 4-share run.
        assert torch.equal(four[rank]["after"][0], one[rank]["after"][0])
        torch.testing.assert_close(four[rank]["after"][1], one[rank]["after"][1] + 1.5)  # (row - sent) + synced: rounded
    average = (_tensors(0)[0] + _tensors(1)[0]) / 2
    rows = torch.arange(0, 300, 3)
    assert torch.equal(one[0]["after"][0][rows], average[rows]) and torch.equal(one[1]["after"][0][rows], average[rows])

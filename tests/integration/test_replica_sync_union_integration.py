"""The replica group's agreement on touched rows (``ReplicaSynchronizer._union``), both ways, 2 processes (gloo)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys.parallel.sync.replica_sync import ReplicaSynchronizer
from lightning_recsys.parallel.sync.replica_sync_config import ReplicaSyncConfig

pytestmark = pytest.mark.slow
TOTAL = 1000  # bitmap: 125 bytes, so up to 31 touched rows go as int32 ids


def _rows(rank: int, count: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 100 + count)
    return torch.randperm(TOTAL, generator=g)[:count].sort().values


def _agree(rank: int, world: int, counts: list[tuple[int, int]]) -> list:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    sync = ReplicaSynchronizer([torch.zeros(4)], dist.group.WORLD, config=ReplicaSyncConfig(), count_aware=True)
    out = []
    for pair in counts:
        union, how, _, touches = sync._union(_rows(rank, pair[rank]), TOTAL, with_counts=True)
        out.append((union.tolist(), how, touches.tolist()))
    return out


def test_both_agreements_give_the_sorted_union_and_how_many_replicas_touched_each_row():
    counts = [(10, 20), (100, 300), (0, 5), (0, 0)]
    results = run_ranks(_agree, 2, counts, timeout=120)
    assert results[0] == results[1]
    for (a, b), (union, how, touches) in zip(counts, results[0]):
        mine, theirs = set(_rows(0, a).tolist()), set(_rows(1, b).tolist())
        assert union == sorted(mine | theirs)
        assert touches == [(r in mine) + (r in theirs) for r in union]
        assert how == ("none" if not union else "indices" if max(a, b) * 4 < 125 else "bitmap")
    assert [how for _, how, _ in results[0]] == ["indices", "bitmap", "indices", "none"]

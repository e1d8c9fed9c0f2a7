"""Metrics sync across real ranks."""

import torch
import torch.distributed as dist

from lightning_recsys.models import NormalizedEntropy
from multiprocess import run_ranks

LOGITS = torch.tensor([1.5, -0.5, 0.3, -2.0, 0.8, -1.2])
LABELS = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])


def _ne_on_rank(rank: int, world_size: int) -> float:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        metric = NormalizedEntropy()
        part = slice(rank * 3, rank * 3 + 3)
        metric.update(LOGITS[part], LABELS[part])
        return metric.compute().item()
    finally:
        dist.destroy_process_group()


def test_normalized_entropy_syncs_across_ranks():
    single = NormalizedEntropy()
    single.update(LOGITS, LABELS)
    expected = single.compute().item()
    local_only = NormalizedEntropy()
    local_only.update(LOGITS[:3], LABELS[:3])
    assert abs(local_only.compute().item() - expected) > 1e-3  # the test would notice a missing sync
    results = run_ranks(_ne_on_rank, 2, timeout=60)
    assert results == [expected, expected] or all(abs(r - expected) < 1e-12 for r in results)

"""How a paced sync's payload is cut into parts (sync_deltas._cut): every byte once, in order, parts about equal."""

from __future__ import annotations

import pytest
import torch

from lightning_recsys.parallel.sync_deltas import _cut


def _bytes(part: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in part)


@pytest.mark.parametrize("slots", [1, 2, 4, 16])
def test_parts_cover_every_element_once_in_order_and_are_about_equal(slots):
    weights = torch.arange(70_000, dtype=torch.bfloat16)  # 140,000 bytes
    state = torch.arange(30_000, dtype=torch.float32)  # 120,000 bytes
    parts = _cut([weights, state], bucket_bytes=64 * 1024 * 1024, slots=slots, min_bytes=1)
    assert len(parts) == slots
    pieces = [piece for part in parts for piece in part]
    for flat in (weights, state):  # the pieces are views into the buffers, end to end
        mine = [p for p in pieces if p.dtype == flat.dtype]
        assert all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in mine)
        assert torch.equal(torch.cat(mine), flat)
    sizes = [_bytes(part) for part in parts]
    assert sum(sizes) == 260_000
    assert max(sizes) - min(sizes) <= 4, sizes  # equal to the element


def test_small_payloads_take_fewer_parts_and_buckets_cap_pieces():
    flat = torch.zeros(1000)  # 4,000 bytes
    assert len(_cut([flat], bucket_bytes=1 << 20, slots=8, min_bytes=1500)) == 2
    assert len(_cut([flat], bucket_bytes=1 << 20, slots=8, min_bytes=1 << 20)) == 1
    parts = _cut([flat], bucket_bytes=400, slots=2, min_bytes=1)
    assert len(parts) == 2 and all(_bytes(piece) <= 400 for part in parts for piece in [*part])
    assert sum(len(part) for part in parts) == 10
    empty = _cut([torch.zeros(0)], bucket_bytes=400, slots=4, min_bytes=1)
    assert len(empty) == 1  # one empty all-reduce, as every replica does the same

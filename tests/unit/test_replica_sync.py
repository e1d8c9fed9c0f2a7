import torch

from lightning_recsys.parallel.replica_sync import _buckets, _unique_floating


def test_buckets_respect_the_byte_cap_and_keep_dtypes_apart():
    f32 = [torch.zeros(10) for _ in range(5)]  # 40 bytes each
    f64 = [torch.zeros(4, dtype=torch.float64)]
    buckets = _buckets(f32[:2] + f64 + f32[2:], bucket_bytes=100)
    assert [[t.dtype for t in b] for b in buckets] == [[torch.float32] * 2, [torch.float64], [torch.float32] * 2, [torch.float32]]
    big = torch.zeros(1000)
    assert _buckets([big], bucket_bytes=100) == [[big]]


def test_integer_state_views_and_duplicates_are_left_out():
    weights = torch.zeros(6)
    step = torch.zeros(1, dtype=torch.int64)
    unique = _unique_floating([weights, step, weights[:6], torch.empty(0)])
    assert len(unique) == 1 and unique[0] is weights

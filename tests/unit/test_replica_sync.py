import pytest
import torch

from lightning_recsys.parallel.sync.replica_sync import _buckets, _unique_floating


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


def test_captured_bases_come_back_sorted_and_a_late_sync_rebases_them():
    from lightning_recsys.parallel.sync.touched_rows import Table

    weight, state = torch.arange(12.0).view(6, 2), torch.arange(6.0)
    table = Table(0, 6, [weight, state])
    for rows in (torch.tensor([4, 1]), torch.tensor([3])):  # two forwards, first touches captured
        table.base_rows.append(rows)
        table.base_values.append([t.index_select(0, rows) for t in table.tensors])
    rows, values = table.bases()
    assert rows.tolist() == [1, 3, 4]
    assert torch.equal(values[0], weight[[1, 3, 4]]) and torch.equal(values[1], state[[1, 3, 4]])
    # A sync of rows 0, 3, 4 applied after the capture: the bases of 3 and 4 become the synced values.
    table.rebase(0, torch.tensor([0, 3, 4]), torch.full((3, 2), -1.0))
    rows, values = table.take_bases()
    assert values[0].tolist() == [[2.0, 3.0], [-1.0, -1.0], [-1.0, -1.0]]
    assert torch.equal(values[1], state[[1, 3, 4]])  # the other tensor is left alone
    assert table.bases()[0].numel() == 0  # taken


def test_bit_packing_round_trips():
    from lightning_recsys.parallel.sync.touched_rows import pack_bits, unpack_bits

    mask = torch.rand(37, generator=torch.Generator().manual_seed(0)) < 0.3
    packed = pack_bits(mask)
    assert packed.numel() == 5 and torch.equal(unpack_bits(packed, 37), mask)


def test_run_summary_shows_rows_per_sync_and_the_touched_fraction():
    from lightning_recsys.callbacks import format_summary

    summary = {
        "world_size": 4, "global_steps": 10, "timed_steps": 8, "examples_per_sec": 1.0, "step_time_ms": 1.0, "forward_ms": 1.0,
        "backward_ms": 1.0, "optimizer_ms": 1.0, "peak_memory_mib": 1.0, "metrics": {},
        "replica_sync": {"syncs": 10, "rows_per_sync": 1234.0, "rows_total": 100_000, "touched_fraction": 0.01234, "bytes_per_sync": 98_720.0},
    }
    text = format_summary(summary)
    line = next(line for line in text.splitlines() if "rows per sync (touched fraction)" in line)
    assert line.split(")", 1)[1].strip() == "1,234 of 100,000 (1.23%)"
    assert "bytes per sync" in text and "98,720" in text


def test_run_summary_says_which_step_the_validation_metrics_describe():
    from lightning_recsys.callbacks import format_summary

    summary = {
        "world_size": 2, "global_steps": 20, "timed_steps": 18, "examples_per_sec": 1.0, "step_time_ms": 1.0, "forward_ms": 1.0,
        "backward_ms": 1.0, "optimizer_ms": 1.0, "peak_memory_mib": 1.0, "metrics": {"train/loss": 0.5, "val/auc": 0.66},
        "val_metrics_step": 13,
    }
    lines = format_summary(summary).splitlines()
    assert next(line for line in lines if "val/auc" in line).endswith("0.66 (step 13)")
    assert next(line for line in lines if "train/loss" in line).endswith("0.5")


def test_an_overlapped_sync_is_split_into_shares_of_about_equal_bytes_that_cover_every_value_once():
    from lightning_recsys.parallel.sync import sync_deltas

    chunks = [torch.arange(100, dtype=torch.float32), torch.arange(100, 130, dtype=torch.float32), torch.arange(7, dtype=torch.bfloat16)]
    old = sync_deltas.MIN_PIECE_BYTES
    try:
        sync_deltas.MIN_PIECE_BYTES = 64
        shares = sync_deltas._split_shares(chunks, 4)
        sizes = [sum(c.numel() * c.element_size() for c in share) for share in shares]
        assert len(shares) == 4 and sum(sizes) == 100 * 4 + 30 * 4 + 7 * 2 and max(sizes) - min(sizes) <= 3 * 4, sizes  # within a few values
        assert torch.equal(torch.cat([c.float() for share in shares for c in share]), torch.cat([c.float() for c in chunks]))
        sync_deltas.MIN_PIECE_BYTES = 200  # 534 bytes: two shares at most
        assert len(sync_deltas._split_shares(chunks, 4)) == 2
    finally:
        sync_deltas.MIN_PIECE_BYTES = old
    with pytest.raises(ValueError, match="pieces=3: must be 1, or more with async_op=True"):
        sync_deltas.InFlightSync([], None, 2, bucket_bytes=1024, async_op=False, pieces=3)  # type: ignore[arg-type]

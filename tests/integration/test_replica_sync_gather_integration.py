"""The all-gather exchange of touched rows (``sync_gather.GatheredSync``), 3 processes (gloo): the average, bit-identical replicas.

Each rank holds the same two tables (a weight [rows, 4] and a row-aligned optimizer state [rows]) as
of a last sync, touches its own rows (some shared with other ranks, one rank none at all), captures
their bases as the row tracker does, and changes them; the exchange must then write
``base + sum(changes) / replicas`` on the union of the touched rows and leave every other row alone.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning_recsys.testing.processes import run_ranks

from lightning_recsys.parallel.sync import sync_deltas
from lightning_recsys.parallel.sync.sync_gather import GatheredSync
from lightning_recsys.parallel.sync.touched_rows import Table

pytestmark = pytest.mark.slow
WORLD = 3
ROWS = (60, 9)


def _touched(rank: int, table: int) -> torch.Tensor:
    if rank == 2 and table == 1:
        return torch.empty(0, dtype=torch.long)  # a replica that touched nothing of a table still takes part
    g = torch.Generator().manual_seed(10 * rank + table)
    return torch.randperm(ROWS[table], generator=g)[: ROWS[table] // 3].sort().values


def _change(rank: int, table: int, tensor: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 100 * rank + 10 * table + tensor)
    return torch.randn(shape, generator=g) * (0.1 if tensor == 0 else 0.01)


def _tables() -> list[Table]:
    g = torch.Generator().manual_seed(7)  # every replica starts equal, as right after a sync
    tables, offset = [], 0
    for rows in ROWS:
        tables.append(Table(offset, rows, [torch.randn(rows, 4, generator=g), torch.rand(rows, generator=g)]))
        offset += rows
    return tables


def _touch(table: Table, rows: torch.Tensor, changes: list[torch.Tensor]) -> None:
    """What a step does to its touched rows: capture their values at first touch, then update them."""
    if rows.numel():
        table.base_rows.append(rows)
        table.base_values.append([t.index_select(0, rows) for t in table.tensors])
    for t, change in zip(table.tensors, changes):
        t.index_add_(0, rows, change)


def _exchange(rank: int, world: int, precision: str, count_aware: bool, overlap: bool, defer: bool = False, pieces: int = 1) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    sync_deltas.MIN_PIECE_BYTES = 64  # these tables' buffers are a few hundred bytes: let them split
    tables = _tables()
    rows = [_touched(rank, k) for k in range(len(tables))]
    for k, table in enumerate(tables):
        _touch(table, rows[k], [_change(rank, k, i, (rows[k].numel(), *t.shape[1:])) for i, t in enumerate(table.tensors)])
    at_launch = [[t.clone() for t in table.tensors] for table in tables]
    sync = GatheredSync(
        tables, rows, dist.group.WORLD, world, weight_precision=precision, overlap=overlap, count_aware=count_aware,
        defer_exchange=defer, exchange_pieces=pieces,
    )
    payload_at_launch = sync.payload_bytes
    payload_after_progress = []
    for _ in range(pieces if defer else 0):
        sync.progress()  # what ReplicaSynchronizer.step_ended does at each step after the launch
        payload_after_progress.append(sync.payload_bytes)
    later = {}
    if overlap:  # a step runs while the exchange is in flight: it touches rows 0-2 of table 0 (a new interval)
        later_rows = torch.arange(3)
        later = {"rows": later_rows, "change": _change(rank, 9, 0, (3, 4))}
        _touch(tables[0], later_rows, [later["change"], torch.zeros(3)])
    sync.apply()
    captured = tables[0].bases() if overlap else None
    return {
        "after": [[t.clone() for t in table.tensors] for table in tables],
        "at_launch": at_launch,
        "rows_synced": sync.rows_synced,
        "payload": sync.payload_bytes,
        "payload_at_launch": payload_at_launch,
        "payload_after_progress": payload_after_progress,
        "deferred_payload": sync.deferred_payload_bytes,
        "captured": captured,
        "marks_left": sum(int(table.marks().count_nonzero()) for table in tables),  # must be 0 for the next sync
    }


def _expected(precision_exact: bool, count_aware: bool) -> list[list[torch.Tensor]]:
    """``base + sum(changes) / divisor`` on the union (fp32 changes, exact inputs)."""
    out = []
    for k, table in enumerate(_tables()):
        expected = []
        for i, base in enumerate(table.tensors):
            summed = torch.zeros_like(base)
            touches = torch.zeros(base.shape[0])
            for rank in range(WORLD):
                rows = _touched(rank, k)
                summed.index_add_(0, rows, _change(rank, k, i, (rows.numel(), *base.shape[1:])))
                touches.index_add_(0, rows, torch.ones(rows.numel()))
            divisor = touches.clamp(min=1) if count_aware else torch.full_like(touches, WORLD)
            expected.append(base + summed / divisor.view(-1, *([1] * (base.dim() - 1))))
        out.append(expected)
    return out


@pytest.mark.parametrize(("precision", "count_aware"), [("fp32", False), ("bf16", False), ("fp8", False), ("fp32", True)])
def test_gathered_changes_average_to_base_plus_mean_change_on_every_replica(precision, count_aware):
    results = run_ranks(_exchange, WORLD, precision, count_aware, False, timeout=120)
    expected = _expected(precision == "fp32", count_aware)
    union = [sorted(set().union(*(set(_touched(r, k).tolist()) for r in range(WORLD)))) for k in range(len(ROWS))]
    for rank in range(WORLD):
        assert results[rank]["rows_synced"] == sum(len(u) for u in union)
        assert results[rank]["marks_left"] == 0
        for k in range(len(ROWS)):
            for i, value in enumerate(results[rank]["after"][k]):
                assert torch.equal(value, results[0]["after"][k][i]), (precision, rank, k, i)  # replicas bit-identical
                # Weights: the wire precision's rounding of each change; the optimizer state always goes as fp32.
                atol = {"fp32": 1e-6, "bf16": 2e-3, "fp8": 2e-2}[precision] if i == 0 else 1e-6
                torch.testing.assert_close(value, expected[k][i], rtol=0, atol=atol, msg=f"{precision} {rank} {k} {i}")
                untouched = torch.ones(ROWS[k], dtype=torch.bool)
                untouched[union[k]] = False
                base = _tables()[k].tensors[i]
                assert torch.equal(value[untouched], base[untouched]), (precision, rank, k, i)
    if precision != "fp32":
        largest = max(float((results[0]["after"][k][0] - expected[k][0]).abs().max()) for k in range(len(ROWS)))
        assert largest > 0, f"{precision} changes gave the fp32 result exactly: the compressed path did not run"


def test_an_overlapped_exchange_keeps_the_changes_made_in_flight_and_rebases_them():
    results = run_ranks(_exchange, WORLD, "fp32", False, True, timeout=120)
    expected = _expected(True, False)
    for rank in range(WORLD):
        weight = results[rank]["after"][0][0]
        later = torch.zeros_like(weight)
        later[:3] = _change(rank, 9, 0, (3, 4))
        # The average of the launched changes, plus this replica's own change made while in flight.
        torch.testing.assert_close(weight, expected[0][0] + later, rtol=0, atol=1e-6)
        assert torch.equal(weight[3:], results[0]["after"][0][0][3:])  # rows nobody changed in flight: identical
        captured_rows, captured_values = results[rank]["captured"]
        assert captured_rows.tolist() == [0, 1, 2]
        # The new interval's bases are the synced values, so the next sync sends only the in-flight change.
        torch.testing.assert_close(captured_values[0], expected[0][0][:3], rtol=0, atol=1e-6)


def test_a_deferred_exchange_sends_only_the_counts_at_launch_and_writes_the_same_values():
    immediate = run_ranks(_exchange, WORLD, "fp8", False, True, timeout=120)
    deferred = run_ranks(_exchange, WORLD, "fp8", False, True, True, timeout=120)
    for rank in range(WORLD):
        counts_bytes = 8 * len(ROWS)  # one int64 row count per table
        assert deferred[rank]["payload_at_launch"] == counts_bytes < immediate[rank]["payload_at_launch"], rank
        assert deferred[rank]["payload"] == immediate[rank]["payload"], rank
        assert deferred[rank]["deferred_payload"] == deferred[rank]["payload"] - counts_bytes, rank
        for k in range(len(ROWS)):
            for a, b in zip(deferred[rank]["after"][k], immediate[rank]["after"][k]):
                assert torch.equal(a, b), (rank, k)


def test_a_deferred_exchange_in_pieces_sends_one_piece_per_progress_and_writes_the_same_values():
    immediate = run_ranks(_exchange, WORLD, "fp8", False, True, timeout=120)
    in_pieces = run_ranks(_exchange, WORLD, "fp8", False, True, True, 3, timeout=120)
    for rank in range(WORLD):
        counts_bytes = 8 * len(ROWS)
        sent = [counts_bytes, *in_pieces[rank]["payload_after_progress"]]
        pieces = [b - a for a, b in zip(sent, sent[1:])]
        assert len(pieces) == 3 and all(p > 0 for p in pieces), (rank, sent)
        assert max(pieces) - min(pieces) <= 1, (rank, pieces)  # equal pieces, whatever the rank sent
        assert in_pieces[rank]["payload"] == immediate[rank]["payload"], rank
        for k in range(len(ROWS)):
            for a, b in zip(in_pieces[rank]["after"][k], immediate[rank]["after"][k]):
                assert torch.equal(a, b), (rank, k)


def test_exchange_pieces_need_a_deferred_exchange():
    with pytest.raises(ValueError, match="exchange_pieces=3: must be 1, or more with defer_exchange=True"):
        GatheredSync(_tables(), [torch.arange(2), torch.arange(1)], None, 2, weight_precision="bf16", overlap=True, exchange_pieces=3)  # type: ignore[arg-type]


def test_count_aware_counts_at_most_255_replicas():
    with pytest.raises(ValueError, match="at most 255 replicas, got 256"):
        GatheredSync(_tables(), [torch.arange(2), torch.arange(1)], None, 256, weight_precision="fp32", overlap=False, count_aware=True)  # type: ignore[arg-type]


def _nothing_touched(rank: int, world: int) -> tuple[int, int]:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    tables = _tables()
    sync = GatheredSync(tables, [torch.empty(0, dtype=torch.long)] * 2, dist.group.WORLD, world, weight_precision="bf16", overlap=True)
    sync.apply()
    assert all(torch.equal(a, b) for table, fresh in zip(tables, _tables()) for a, b in zip(table.tensors, fresh.tensors))
    return sync.rows_synced, sync.payload_bytes


def test_no_replica_touching_anything_sends_only_the_counts():
    assert run_ranks(_nothing_touched, 2, timeout=120) == [(0, 16), (0, 16)]

"""RowTracker's bookkeeping (a stand-in kernel module) and the bitmap helpers the union agreement uses."""

import pytest
import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from lightning_recsys.parallel.sync.touched_rows import RowTracker, Table, bits_at, pack_bits, pack_positions, unpack_bits, unpack_positions


class _Kernel(nn.Module):
    """What RowTracker needs of a fused kernel: the feature -> table map and a forward to hook."""

    def __init__(self, feature_table_map: list[int]) -> None:
        super().__init__()
        self._feature_table_map = feature_table_map

    def forward(self, features: KeyedJaggedTensor) -> None:
        return None


def _kjt(per_feature: list[list[int]]) -> KeyedJaggedTensor:
    # one example per feature, holding all its ids
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(per_feature))],
        values=torch.tensor([i for ids in per_feature for i in ids], dtype=torch.long),
        lengths=torch.tensor([len(ids) for ids in per_feature], dtype=torch.long),
    )


def _tracker(capture: bool, sorted_pieces: bool = True) -> tuple[_Kernel, RowTracker, list[torch.Tensor]]:
    # tables of 5 and 7 rows; feature 2 reads table 0 too
    weights = [torch.arange(10.0).view(5, 2), torch.arange(100.0, 114.0).view(7, 2)]
    kernel = _Kernel([0, 1, 0]).train()
    tables = [Table(0, 5, [weights[0]]), Table(5, 7, [weights[1]])]
    tracker = RowTracker(kernel, tables, [5, 7], capture_bases=capture, sorted_pieces=sorted_pieces)
    return kernel, tracker, weights


@pytest.mark.parametrize("keep_positions", [True, False], ids=["positions", "mask-scan"])
def test_touched_rows_are_the_sorted_distinct_lookups_since_the_last_clear(keep_positions):
    kernel, tracker, _ = _tracker(capture=False)
    tracker._keep_positions = keep_positions  # False is what accelerators use (no host sync per lookup)
    kernel(_kjt([[4, 4, 1], [6, 0], [1, 9]]))  # 9 is out of table 0's range: FBGEMM clamps it to row 0
    kernel(_kjt([[], [0, 2], [3]]))
    assert tracker.touched().tolist() == [0, 1, 3, 4, 5, 7, 11]
    assert tracker.mask.nonzero().squeeze(1).tolist() == tracker.touched().tolist()
    with torch.no_grad():  # evaluation marks nothing
        kernel(_kjt([[2], [], []]))
    assert 2 not in tracker.touched().tolist()
    tracker.clear()
    assert tracker.touched().numel() == 0 and int(tracker.mask.sum()) == 0
    kernel(_kjt([[2], [], []]))
    assert tracker.touched().tolist() == [2]


@pytest.mark.parametrize("sorted_pieces", [True, False], ids=["sorted", "lookup-order"])
def test_bases_are_captured_once_per_row_before_later_changes(sorted_pieces):
    kernel, tracker, weights = _tracker(capture=True, sorted_pieces=sorted_pieces)
    kernel(_kjt([[3, 3], [1], []]))
    weights[0][3] += 1000.0  # the fused update after the first lookup
    weights[1][1] += 1000.0
    kernel(_kjt([[3, 0], [1], []]))  # row 3 and table 1's row 1 again: their bases stay the first values
    rows, values = tracker.tables[0].bases()
    assert rows.tolist() == [0, 3] and values[0].tolist() == [[0.0, 1.0], [6.0, 7.0]]
    rows, values = tracker.tables[1].bases()
    assert rows.tolist() == [1] and values[0].tolist() == [[102.0, 103.0]]
    positions = tracker.touched()
    assert [(table.offset, lo, hi) for table, lo, hi in tracker.split(positions)] == [(0, 0, 2), (5, 2, 3)]
    tracker.clear()
    assert tracker.tables[0].bases()[0].numel() == 0


def test_lookup_order_capture_keeps_one_base_per_row_however_often_it_repeats():
    # 70,000 ids over 300 rows: rows repeat hundreds of times, and the index needs three base-255 digits.
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(300, 2, generator=g), torch.randn(40, 2, generator=g)]
    kernel = _Kernel([0, 1]).train()
    tracker = RowTracker(kernel, [Table(0, 300, [weights[0]]), Table(300, 40, [weights[1]])], [300, 40], capture_bases=True, sorted_pieces=False)
    ids = [torch.randint(0, 250, (70_000,), generator=g), torch.randint(0, 40, (500,), generator=g)]
    kernel(KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.cat(ids), lengths=torch.tensor([70_000, 500])))
    ids2 = [torch.randint(200, 300, (1000,), generator=g), torch.tensor([], dtype=torch.long)]
    kernel(KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.cat(ids2), lengths=torch.tensor([1000, 0])))
    for k, table in enumerate(tracker.tables):
        expected = torch.unique(torch.cat([ids[k], ids2[k]]))
        rows, values = table.bases(sort=False)
        assert sorted(rows.tolist()) == expected.tolist()  # distinct, every row once
        assert torch.equal(values[0], weights[k][rows])
        assert torch.equal(table.bases()[0], expected)  # sorted on request
    assert torch.equal(tracker.touched(), torch.cat([torch.unique(torch.cat([ids[0], ids2[0]])), 300 + torch.unique(ids[1])]))


def test_bit_packing_from_positions_matches_the_mask_and_round_trips():
    g = torch.Generator().manual_seed(0)
    for total in (1, 7, 8, 37, 1000):
        mask = torch.rand(total, generator=g) < 0.3
        positions = mask.nonzero().squeeze(1)
        packed = pack_bits(mask)
        assert packed.numel() == (total + 7) // 8
        assert torch.equal(unpack_bits(packed, total), mask)
        assert torch.equal(pack_positions(positions, total), packed)
        assert torch.equal(unpack_positions(packed), positions)
        probe = torch.arange(total)
        assert torch.equal(bits_at(packed, probe), mask.long())

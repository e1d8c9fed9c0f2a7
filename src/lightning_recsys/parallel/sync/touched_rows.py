"""Which rows of the fused embedding kernels' local shards were looked up since the last replica sync.

``RowTracker`` marks them from a forward pre-hook on each fused kernel (1 byte per local row, plus
the positions of the rows marked since the last sync) and,
for delta syncs, keeps each marked row's values as they were at its first touch: the rows' values
as of the last sync (O(rows touched) memory; the fused update runs later, in backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbedding, BatchedFusedEmbeddingBag

FUSED_KERNELS = (BatchedFusedEmbeddingBag, BatchedFusedEmbedding)
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


@dataclass
class Table:
    """One local shard of one table inside a fused kernel: its rows in the kernel's mask."""

    offset: int  # first row in the kernel's mask
    rows: int
    tensors: list[torch.Tensor]  # the weight [rows, dim] first, then the row-aligned optimizer state ([rows] or [rows, dim])
    # Delta syncs: rows first touched since the last sync (table-local ids, distinct) and their values then, per tensor.
    base_rows: list[torch.Tensor] = field(default_factory=list)
    base_values: list[list[torch.Tensor]] = field(default_factory=list)
    _compacted: Optional[torch.Tensor] = field(default=None, repr=False)  # the one piece bases() made
    _compacted_sorted: bool = field(default=False, repr=False)
    _marks: Optional[torch.Tensor] = field(default=None, repr=False)  # see marks()

    def marks(self) -> torch.Tensor:
        """A zeroed byte per row for the all-gather sync to count senders in (allocated once); it zeroes what it sets."""
        if self._marks is None:
            self._marks = torch.zeros(self.rows, dtype=torch.uint8, device=self.tensors[0].device)
        return self._marks

    def take_bases(self, *, sort: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``bases(sort=sort)``, and clears the store."""
        rows, values = self.bases(sort=sort)
        self.base_rows, self.base_values = [], []
        return rows, values

    def bases(self, *, sort: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The captured rows (sorted, or in capture order with ``sort=False``) and their values per tensor,
        compacted into one piece each."""
        device = self.tensors[0].device
        if not self.base_rows:
            return torch.empty(0, dtype=torch.long, device=device), [t.new_empty((0, *t.shape[1:])) for t in self.tensors]
        if len(self.base_rows) == 1 and self.base_rows[0] is self._compacted and (self._compacted_sorted or not sort):
            return self.base_rows[0], self.base_values[0]  # compacted already, nothing captured since
        rows = torch.cat(self.base_rows)
        values = [torch.cat([piece[j] for piece in self.base_values]) for j in range(len(self.tensors))]
        if sort:
            order = torch.argsort(rows)
            rows, values = rows[order], [v[order] for v in values]
        self.base_rows, self.base_values = [rows], [values]
        self._compacted, self._compacted_sorted = rows, sort
        return rows, values

    def rebase(self, index: int, rows: torch.Tensor, synced: torch.Tensor) -> None:
        """A sync of ``rows`` was applied late (overlap): tensor ``index``'s values captured meanwhile are pre-sync; make them ``synced``."""
        captured, values = self.bases()
        if captured.numel() == 0 or rows.numel() == 0:
            return
        where = torch.searchsorted(rows, captured).clamp_(max=rows.numel() - 1)
        hit = rows[where] == captured
        if bool(hit.any()):
            values[index][hit] = synced[where[hit]].to(values[index].dtype)

    def clear(self) -> None:
        self.base_rows, self.base_values = [], []


class RowTracker:
    """Marks the local rows a fused kernel looks up, from a forward pre-hook.

    The hook sees the ``KeyedJaggedTensor`` a kernel receives after TorchRec's input distribution:
    its ids are row numbers of the kernel's local shards already (table_wise: the table's rows;
    row_wise: bucketized to the shard's block, offset removed; column_wise / table_column_wise: every
    column shard holds all rows and gets the full ids). Key ``i`` belongs to table
    ``kernel._feature_table_map[i]``. Ids out of a table's range mark row 0, the row FBGEMM's bounds
    check clamps them to. With ``capture_bases`` a row's values are copied at its first touch since
    the last sync (before the fused update changes them in backward). With ``sorted_pieces=False`` (the
    all-gather sync, which needs no order) a lookup's new rows are kept in lookup order, made distinct
    without a sort (``_first_of_each``); otherwise each lookup's are sorted, so ``touched()`` and
    ``Table.bases()`` sort nearly sorted runs.

    On the CPU (and with ``capture_bases``) a lookup costs O(ids): a gather from the 1-byte mask
    finds the rows not marked yet, an ``index_fill_`` marks them and their positions are kept;
    ``touched()`` sorts those once per sync, and nothing scans the whole mask. On an accelerator the
    hook only marks the mask (keeping positions would need a host sync per lookup) and ``touched()``
    scans it once per sync, which is cheap there.
    """

    def __init__(
        self, module: nn.Module, tables: list[Table], row_counts: list[int], *, capture_bases: bool = False, sorted_pieces: bool = True
    ) -> None:
        self.tables = tables
        self.capture_bases = capture_bases
        self.sorted_pieces = sorted_pieces
        device = tables[0].tensors[0].device
        offsets = [0]
        for rows in row_counts:
            offsets.append(offsets[-1] + rows)
        feature_table = torch.tensor(list(module._feature_table_map), dtype=torch.long)  # type: ignore[attr-defined]
        self._num_features = int(feature_table.numel())
        self._feature_rows = torch.tensor(row_counts, dtype=torch.long)[feature_table].to(device)
        self._feature_offsets = torch.tensor(offsets[:-1], dtype=torch.long)[feature_table].to(device)
        # The synced tables' [first, end) in the mask, for splitting sorted positions by table.
        self._table_bounds = torch.tensor([b for t in tables for b in (t.offset, t.offset + t.rows)], dtype=torch.long, device=device)
        tracked = {(t.offset, t.rows): t for t in tables}
        self._feature_tables = [tracked.get((offsets[i], row_counts[i])) for i in feature_table.tolist()]
        self._has_empty_tables = any(rows == 0 for rows in row_counts)
        self.mask = torch.zeros(offsets[-1], dtype=torch.uint8, device=device)
        self._fresh: list[torch.Tensor] = []  # positions first marked since the last sync (one piece per lookup)
        self._sorted = False  # _fresh is one sorted piece without repeats
        self._keep_positions = device.type == "cpu" or capture_bases
        self._handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not module.training or not torch.is_grad_enabled():
            return  # evaluation updates nothing
        features = args[0] if args else kwargs["features"]
        ids = features.values()
        if ids.numel() == 0:
            return
        if len(features.keys()) != self._num_features:
            raise RuntimeError(
                f"replica sync: a fused embedding kernel got {len(features.keys())} features, its config has "
                f"{self._num_features}; touched rows cannot be told apart. Use ReplicaSyncConfig(rows='all')."
            )
        if features.variable_stride_per_key():
            per_feature = torch.tensor(features.length_per_key(), dtype=torch.long, device=ids.device)
        else:
            per_feature = features.lengths().view(self._num_features, -1).sum(1)
        feature = torch.repeat_interleave(
            torch.arange(self._num_features, device=ids.device), per_feature, output_size=ids.numel()
        )
        ids = ids.long()
        valid = (ids >= 0) & (ids < self._feature_rows[feature])
        positions = self._feature_offsets[feature] + torch.where(valid, ids, torch.zeros_like(ids))
        if self._has_empty_tables:  # an empty table has no row 0 to clamp to: its ids mark nothing
            positions = positions[self._feature_rows[feature] > 0]
            per_feature = per_feature * (self._feature_rows > 0)
        if not self._keep_positions:
            self.mask.index_fill_(0, positions, 1)
            self._sorted = False
            return
        if self.capture_bases and not self.sorted_pieces:
            self._record_in_order(positions, per_feature)
            return
        fresh = positions[self.mask.index_select(0, positions) == 0]  # may repeat a row looked up twice in this batch
        if fresh.numel():
            self.mask.index_fill_(0, fresh, 1)
            if self.capture_bases:
                fresh = torch.unique(fresh)  # sorted; the kernel has not updated these rows yet
                self._capture(fresh)
            self._fresh.append(fresh)
            self._sorted = False

    def _record_in_order(self, positions: torch.Tensor, per_feature: torch.Tensor) -> None:
        """Mark and capture a lookup's new rows with no sort: the lookup's ids are feature by feature, a feature reads one table."""
        fresh_at = (self.mask.index_select(0, positions) == 0).nonzero().squeeze(1)
        if fresh_at.numel() == 0:
            return
        fresh_at = fresh_at.index_select(0, self._first_of_each(positions.index_select(0, fresh_at)))
        fresh = positions.index_select(0, fresh_at)
        self.mask.index_fill_(0, fresh, 1)
        starts = torch.zeros(self._num_features + 1, dtype=torch.long, device=fresh_at.device)
        torch.cumsum(per_feature, 0, out=starts[1:])
        bounds = torch.searchsorted(fresh_at, starts).tolist()
        with torch.no_grad():
            for table, lo, hi in zip(self._feature_tables, bounds[:-1], bounds[1:]):
                if table is not None and hi > lo:
                    rows = fresh[lo:hi] - table.offset
                    table.base_rows.append(rows)
                    table.base_values.append([t.index_select(0, rows) for t in table.tensors])
        self._fresh.append(fresh)
        self._sorted = False

    def _first_of_each(self, fresh: torch.Tensor) -> torch.Tensor:
        """Indices of one occurrence of each distinct row in ``fresh`` (rows unmarked in the mask), in order.

        No sort: each occurrence writes a tag, a base-255 digit of its index, into its row's byte, and
        only occurrences whose tag stayed survive. Survivors of one row share that digit, so the next
        digit tells them apart; after the digits of ``len(fresh)`` one is left per row.
        """
        keep = torch.arange(fresh.numel(), device=fresh.device)
        digit = 1
        while True:
            rows = fresh.index_select(0, keep)
            tag = ((keep if digit == 1 else keep // digit) % 255 + 1).to(torch.uint8)
            self.mask.index_put_((rows,), tag)  # one occurrence's tag stays per row
            keep = keep[self.mask.index_select(0, rows) == tag]
            if digit * 255 >= fresh.numel():
                return keep
            digit *= 255

    def touched(self) -> torch.Tensor:
        """The sorted positions (in the mask) of the rows looked up since the last sync."""
        if not self._sorted:
            if self._keep_positions:
                pieces = self._fresh or [torch.empty(0, dtype=torch.long, device=self.mask.device)]
                self._fresh = [torch.unique(torch.cat(pieces))]
            else:
                self._fresh = [self.mask.nonzero().squeeze(1)]
            self._sorted = True
        return self._fresh[0]

    @torch.no_grad()
    def _capture(self, fresh: torch.Tensor) -> None:
        bounds = torch.searchsorted(fresh, self._table_bounds).tolist()
        for table, lo, hi in zip(self.tables, bounds[0::2], bounds[1::2]):
            if hi > lo:
                rows = fresh[lo:hi] - table.offset
                table.base_rows.append(rows)
                table.base_values.append([t.index_select(0, rows) for t in table.tensors])

    def split(self, positions: torch.Tensor, start: int = 0) -> list[tuple[Table, int, int]]:
        """For sorted ``positions`` (this tracker's mask shifted by ``start``): each table with rows there, and their slice."""
        bounds = torch.searchsorted(positions, self._table_bounds + start).tolist()
        return [(table, lo, hi) for table, lo, hi in zip(self.tables, bounds[0::2], bounds[1::2]) if hi > lo]

    def clear(self) -> None:
        """Forget the touched rows and captured values (a new interval starts)."""
        if not self._keep_positions:
            self.mask.zero_()
        else:
            for piece in self._fresh:  # O(rows touched), not O(rows); unsorted pieces will do
                self.mask.index_fill_(0, piece, 0)
        self._fresh, self._sorted = [], False
        for table in self.tables:
            table.clear()

    def remove(self) -> None:
        self._handle.remove()


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A 0/1 byte (or bool) mask packed 8 rows per byte, row ``8k + j`` in bit ``j`` of byte ``k``."""
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    # 8 bytes of 0/1 as one int64 (little-endian hosts: byte j at bit 8j), shifted together into its low byte.
    x = padded.view(torch.int64)
    x = x | (x >> 7)
    x = x | (x >> 14)
    x = x | (x >> 28)
    return (x & 0xFF).to(torch.uint8)[: (mask.numel() + 7) // 8]


def unpack_bits(packed: torch.Tensor, total: int) -> torch.Tensor:
    bits = packed.unsqueeze(1).bitwise_and(_BITS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:total]


def pack_positions(positions: torch.Tensor, total: int) -> torch.Tensor:
    """``pack_bits`` of the mask of ``total`` rows set at the distinct ``positions``, in O(positions) work."""
    packed = torch.zeros((total + 7) // 8, dtype=torch.uint8, device=positions.device)
    bits = torch.ones_like(positions, dtype=torch.uint8).bitwise_left_shift_((positions & 7).to(torch.uint8))
    return packed.index_put_((positions >> 3,), bits, accumulate=True)  # distinct bits of a byte: their sum is their OR


def unpack_positions(packed: torch.Tensor) -> torch.Tensor:
    """The sorted positions of the bits set in ``packed``: a scan of its bytes, then only the non-zero ones."""
    nonzero = packed.nonzero().squeeze(1)
    bits = packed.index_select(0, nonzero).unsqueeze(1).bitwise_and(_BITS.to(packed.device)).ne(0)
    return (nonzero.unsqueeze(1) * 8 + torch.arange(8, device=packed.device)).masked_select(bits)


def bits_at(packed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The bits of ``packed`` at ``positions`` (0/1, int64)."""
    return packed.index_select(0, positions >> 3).long().bitwise_right_shift(positions & 7).bitwise_and_(1)


def fused_kernels(modules: list[nn.Module]) -> list[nn.Module]:
    """The fused TBE kernels of sharded EBC/EC modules (their lookups sit in a plain list, ``_lookups``)."""
    kernels: list[nn.Module] = []
    for module in modules:
        for sharded in module.modules():
            for lookup in getattr(sharded, "_lookups", None) or []:
                kernels += [m for m in lookup.modules() if isinstance(m, FUSED_KERNELS) and all(m is not k for k in kernels)]
    return kernels


def tensor_key(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    return (t.data_ptr(), t.numel(), t.dtype)


def track(
    tensors: list[torch.Tensor], kernels: list[nn.Module], *, capture_bases: bool = False, sorted_pieces: bool = True
) -> tuple[list[RowTracker], list[torch.Tensor]]:
    """Row trackers for the fused kernels' tables among ``tensors``; the tensors no tracker covers."""
    wanted = {tensor_key(t): t for t in tensors}
    covered: set[tuple[int, int, torch.dtype]] = set()
    trackers: list[RowTracker] = []
    for kernel in kernels:
        weights = kernel.split_embedding_weights()  # type: ignore[operator]
        states = _optimizer_states(kernel)  # per table: FBGEMM's state views
        tables: list[Table] = []
        offset = 0
        row_counts = []
        for index, weight in enumerate(weights):
            rows = int(weight.shape[0])
            row_counts.append(rows)
            table_tensors = [weight, *(states[index] if index < len(states) else [])]
            synced = [t for t in table_tensors if tensor_key(t) in wanted and t.numel() and t.shape[0] == rows]
            if synced and tensor_key(weight) in wanted:
                tables.append(Table(offset, rows, [wanted[tensor_key(t)] for t in synced]))
                covered.update(tensor_key(t) for t in synced)
            offset += rows
        if tables:
            trackers.append(RowTracker(kernel, tables, row_counts, capture_bases=capture_bases, sorted_pieces=sorted_pieces))
    return trackers, [t for t in tensors if tensor_key(t) not in covered]


def _optimizer_states(kernel: nn.Module) -> list[list[torch.Tensor]]:
    emb = getattr(kernel, "_emb_module", None)
    if emb is None or not hasattr(emb, "split_optimizer_states"):
        return []
    try:
        return [list(states) for states in emb.split_optimizer_states()]
    except NotImplementedError:  # OptimType.NONE
        return []


__all__ = ["FUSED_KERNELS", "RowTracker", "Table", "bits_at", "fused_kernels", "pack_bits", "pack_positions", "track", "unpack_bits", "unpack_positions"]

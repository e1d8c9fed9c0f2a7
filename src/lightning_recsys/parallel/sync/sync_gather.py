"""The all-gather exchange of a touched-row replica sync (``ReplicaSyncConfig(exchange="all_gather")``).

Every replica sends the rows it touched since the last sync, with their change ``row - base`` (the
weights at the sync's precision, the optimizer state in fp32), in one byte buffer. Every replica then
decodes every buffer (its own included), puts every row sent back to its ``base`` and adds each
replica's ``change / replicas`` to its rows in replica order, so every replica writes the same bits:
``row = base + change_0 / replicas + change_1 / replicas + ...`` on the union of the rows sent.
``base`` is equal on every replica: the row's value as of the last sync (captured at first touch for
a replica's own rows; the row's value for rows it did not touch). The union is never built (no
sort): a byte per row (``Table.marks``) says which rows were sent, and by how many replicas. There
is no union agreement: one small all-gather of per-table row counts sizes the buffers, and the
buffers' all-gather can run in the background (``overlap``). With ``defer_exchange`` the counts' all-gather runs in the background too
and the buffers' starts at ``progress()`` (the next step's end), so a launch never waits on the network.
With ``exchange_pieces`` > 1 the buffers go in that many all-gathers, one per ``progress()``: the
link carries a piece during a step's forward instead of the whole sync in one burst that the step's
dense all-reduce would queue behind (on a shaped 200 Mbit/s link that burst held up a backward by 20 ms).

Buffer layout, per table in the trackers' order: the row ids, then per synced tensor the encoded
changes; each section padded to 8 bytes so it can be viewed in its dtype. Every replica computes
every other's layout from the gathered counts.

Overlap: the sync is applied an interval late. A row's value at launch is its captured base of the
new interval if it was touched since, else its current value; what changed since launch is kept,
``row = synced + (row_now - row_at_launch)``, and the new interval's captured bases of the synced
rows become ``synced``, so the next sync sends only the later change.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_recsys.parallel.comms import BlockScaledCodec
from lightning_recsys.parallel.sync.sync_deltas import piece_count
from lightning_recsys.parallel.sync.touched_rows import Table

_ALIGN = 8
_WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def change_bytes_per_row(values: int, precision: str) -> int:
    """Bytes one row's change of ``values`` values takes in the buffer at ``precision`` (fp8: plus its fp32 scale)."""
    if precision == "fp8":
        return values + 4
    return values * _WIRE_DTYPES[precision].itemsize


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class _Section:
    """How one synced tensor's changes travel: bytes per row, encode and decode."""

    def __init__(self, tensor: torch.Tensor, precision: str) -> None:
        self.row_shape = tuple(tensor.shape[1:])
        self.row_values = int(torch.Size(self.row_shape).numel())
        self.precision = precision
        self._codec = BlockScaledCodec("fp8_e4m3", block_size=self.row_values) if precision == "fp8" else None
        self.row_bytes = change_bytes_per_row(self.row_values, precision)

    def encode(self, deltas: torch.Tensor) -> torch.Tensor:
        if self._codec is not None:
            return self._codec.encode(deltas.reshape(-1, self.row_values))
        return deltas.to(_WIRE_DTYPES[self.precision]).reshape(-1).view(torch.uint8)

    def decode(self, payload: torch.Tensor, rows: int) -> torch.Tensor:
        if self._codec is not None:
            values = self._codec.decode(payload) if rows else payload.new_empty(0, dtype=torch.float32)
        else:
            values = payload.view(_WIRE_DTYPES[self.precision]).float()
        return values.view(rows, *self.row_shape)


class GatheredSync:
    """One all-gather exchange, launched by the constructor (or its second half by ``progress()``); ``apply()``
    waits for it and writes the average."""

    def __init__(
        self,
        tables: list[Table],
        rows: list[torch.Tensor],
        group: dist.ProcessGroup,
        num_replicas: int,
        *,
        weight_precision: str,
        overlap: bool,
        count_aware: bool = False,
        defer_exchange: bool = False,
        exchange_pieces: int = 1,
    ) -> None:
        """``rows[k]``: the sorted table-local rows this replica touched in ``tables[k]`` (their bases captured).

        ``defer_exchange`` (with ``overlap``): the counts' all-gather runs in the background too, and the
        changes' all-gather starts at ``progress()``, so launching never waits on the network.
        ``exchange_pieces`` (with ``defer_exchange``): send the changes in up to this many all-gathers of at
        least ``sync_deltas.MIN_PIECE_BYTES``, one per ``progress()`` call; ``wait()`` sends what is left.
        """
        if exchange_pieces < 1 or (exchange_pieces > 1 and not defer_exchange):
            raise ValueError(f"exchange_pieces={exchange_pieces}: must be 1, or more with defer_exchange=True")
        if count_aware and num_replicas > 255:
            raise ValueError(
                f"the all-gather replica sync counts the replicas that touched a row in a byte: at most 255 replicas, got "
                f"{num_replicas}. Set ReplicaSyncConfig(average='all_replicas') (the 'auto' default picks the touching "
                "replicas with an adaptive optimizer), or exchange='all_reduce'."
            )
        self._tables = tables
        self._num_replicas = num_replicas
        self._me = dist.get_rank(group)  # this replica's buffer in the gathered list
        self._overlap = overlap
        self._count_aware = count_aware
        device = self._device = tables[0].tensors[0].device
        self._id_dtype = torch.int32 if max(t.rows for t in tables) < 2**31 else torch.int64
        self._sections = [
            [_Section(t, weight_precision if i == 0 else "fp32") for i, t in enumerate(table.tensors)] for table in tables
        ]
        self._rows = rows
        self._bases: list[list[torch.Tensor]] = []
        encoded: list[torch.Tensor] = []
        for table, table_rows, sections in zip(tables, rows, self._sections):
            bases = _own_bases(table, table_rows)
            self._bases.append(bases)
            encoded.append(table_rows.to(self._id_dtype).view(torch.uint8))
            for t, base, section in zip(table.tensors, bases, sections):
                deltas = t.index_select(0, table_rows).float().sub_(base.float())
                encoded.append(section.encode(deltas))
        counts = torch.tensor([r.numel() for r in rows], dtype=torch.int64, device=device)
        self._gathered_counts = [torch.empty_like(counts) for _ in range(num_replicas)]
        self._counts_work: Optional[Any] = dist.all_gather(self._gathered_counts, counts, group=group, async_op=defer_exchange)
        self._encoded: Optional[list[torch.Tensor]] = encoded  # encoded, waiting for the buffers' size
        self._group = group
        self._received: list[torch.Tensor] = []
        self._send = torch.empty(0, dtype=torch.uint8, device=device)
        self._max_pieces = exchange_pieces
        self._piece_bounds: list[int] = []  # byte offsets of the pieces not sent yet (first: the next piece's start)
        self._works: list[Any] = []
        self.payload_bytes = counts.numel() * counts.element_size()  # plus the buffer's once it is sent
        self.deferred_payload_bytes = 0  # the part of payload_bytes sent after the constructor returned
        self.rows_synced = 0  # the union's rows, known once applied
        self._launched = False
        if not defer_exchange:
            self._exchange()
        self._launched = True

    def progress(self) -> None:
        """Send the changes' next piece (``defer_exchange``): the first a step after launch, when the counts have
        arrived. Every replica calls it at the same points (``ReplicaSynchronizer.step_ended``)."""
        if self._encoded is not None:
            self._build_buffers()
        if len(self._piece_bounds) > 1:
            self._send_piece()

    def _exchange(self) -> None:
        self._build_buffers()
        while len(self._piece_bounds) > 1:
            self._send_piece()

    def _build_buffers(self) -> None:
        encoded, self._encoded = self._encoded, None
        assert encoded is not None
        if self._counts_work is not None:
            self._counts_work.wait()
            self._counts_work = None
        self._counts = torch.stack(self._gathered_counts).tolist()
        sizes = [self._buffer_bytes(c) for c in self._counts]
        send = self._send = torch.zeros(max(sizes), dtype=torch.uint8, device=self._device)
        offset = 0
        for piece in encoded:
            send[offset : offset + piece.numel()] = piece
            offset = _aligned(offset + piece.numel())
        self._received = [torch.empty_like(send) for _ in range(self._num_replicas)]
        # Every replica sees the same counts, so the same pieces (none when no replica touched a row).
        count = piece_count(send.numel(), self._max_pieces)
        self._piece_bounds = [send.numel() * i // count for i in range(count + 1)] if send.numel() else []

    def _send_piece(self) -> None:
        start, end = self._piece_bounds[0], self._piece_bounds[1]
        self._piece_bounds.pop(0)
        work = dist.all_gather(
            [buffer[start:end] for buffer in self._received], self._send[start:end], group=self._group, async_op=self._overlap
        )
        if self._overlap:
            self._works.append(work)
        self.payload_bytes += end - start
        if self._launched:
            self.deferred_payload_bytes += end - start

    def _buffer_bytes(self, counts: list[int]) -> int:
        total = 0
        for n, sections in zip(counts, self._sections):
            total += _aligned(n * self._id_dtype.itemsize) + sum(_aligned(n * s.row_bytes) for s in sections)
        return total

    def wait(self) -> None:
        """Wait for the all-gather (raises if a peer failed or the group timed out)."""
        if self._encoded is not None:
            self._build_buffers()
        while len(self._piece_bounds) > 1:
            self._send_piece()
        works, self._works = self._works, []
        for work in works:
            work.wait()
        self._send = self._send.new_empty(0)  # the received buffers hold everything now

    @torch.no_grad()
    def apply(self) -> None:
        """Wait, then write the average of every row any replica sent (``rows_synced`` says how many)."""
        self.wait()
        decoded = [self._decode(buffer, counts) for buffer, counts in zip(self._received, self._counts)]
        self._received = []
        union_rows = 0
        for k, table in enumerate(self._tables):
            sent = [per_replica[k][0] for per_replica in decoded]
            if not any(rows.numel() for rows in sent):
                continue
            # A byte per row counts the replicas that sent it: O(rows sent), no sort of the union.
            marks = table.marks()
            for rows in sent:
                seen = marks.index_select(0, rows)
                union_rows += int(rows.numel()) - int(seen.count_nonzero())
                if self._count_aware:
                    marks.index_copy_(0, rows, seen.add_(1))
                else:
                    marks.index_fill_(0, rows, 1)
            moved: Optional[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = None  # rows touched since launch (overlap)
            if self._overlap:
                captured, captured_values = table.bases(sort=False)
                if captured.numel():
                    at = marks.index_select(0, captured).nonzero().squeeze(1)
                    if at.numel():
                        moved = (captured.index_select(0, at), at, captured_values)
            divisors: list[torch.Tensor | int] = [self._num_replicas] * len(sent)
            if self._count_aware:
                divisors = [marks.index_select(0, rows).float() for rows in sent]
            for rows in sent:
                marks.index_fill_(0, rows, 0)
            for i, t in enumerate(table.tensors):
                shares = [
                    _share(per_replica[k][1][i], divisor).to(t.dtype) for per_replica, divisor in zip(decoded, divisors)
                ]
                _write_average(t, sent, self._rows[k], self._bases[k][i], shares, moved, i)
        self.rows_synced = union_rows

    def _decode(self, buffer: torch.Tensor, counts: list[int]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Per table: one replica's row ids and, per synced tensor, their changes (fp32)."""
        out = []
        offset = 0
        for n, sections in zip(counts, self._sections):
            size = n * self._id_dtype.itemsize
            ids = buffer[offset : offset + size].view(self._id_dtype).long()
            offset = _aligned(offset + size)
            deltas = []
            for section in sections:
                size = n * section.row_bytes
                deltas.append(section.decode(buffer[offset : offset + size], n))
                offset = _aligned(offset + size)
            out.append((ids, deltas))
        return out


def _share(change: torch.Tensor, divisor: torch.Tensor | int) -> torch.Tensor:
    """One replica's part of the average: its change over the replicas (per row with ``count_aware``)."""
    if isinstance(divisor, torch.Tensor):
        return change / divisor.view(-1, *([1] * (change.dim() - 1)))
    return change / divisor


def _write_average(
    t: torch.Tensor,
    sent: list[torch.Tensor],
    own: torch.Tensor,
    own_base: torch.Tensor,
    shares: list[torch.Tensor],
    moved: Optional[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]],
    index: int,
) -> None:
    """``row = base + share_0 + share_1 + ...`` (in replica order) on the rows any replica ``sent``, keeping changes made since launch.

    Every such row first holds its base, its value as of the last sync: ``own_base`` for this
    replica's rows ``own``, the value at launch for the others'. Every replica then adds the same
    shares to the same bases in the same order, so all write the same bits. ``moved``: the rows
    touched since launch, which of the new interval's captured rows they are, and the captured values
    (their value at launch); their change since launch is added on top, and their captured values
    become the synced ones, so the next sync sends only that change.
    """
    if moved is not None:
        moved_rows, at, captured_values = moved
        at_launch = captured_values[index].index_select(0, at)
        change = t.index_select(0, moved_rows).sub_(at_launch)
        t.index_copy_(0, moved_rows, at_launch)
    t.index_copy_(0, own, own_base)
    for rows, share in zip(sent, shares):
        t.index_add_(0, rows, share)
    if moved is not None:
        captured_values[index].index_copy_(0, at, t.index_select(0, moved_rows))
        t.index_add_(0, moved_rows, change)  # fl(synced + change): the change since launch is kept


def _own_bases(table: Table, rows: torch.Tensor) -> list[torch.Tensor]:
    """Per tensor, the values of ``rows`` as of the last sync (captured at first touch); takes them from the table."""
    captured, values = table.take_bases(sort=False)
    if captured is rows:
        return values  # the captured rows are the touched rows (ReplicaSynchronizer sends bases(sort=False)'s rows)
    bases = [t.index_select(0, rows) for t in table.tensors]  # a row without a captured base has not changed
    if captured.numel():
        order = torch.argsort(rows)
        where, hit = _lookup(rows[order], captured)
        for base, value in zip(bases, values):
            base[order[where[hit]]] = value[hit]
    return bases


def _lookup(sorted_rows: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of ``rows``: its position in ``sorted_rows`` and whether it is there."""
    if sorted_rows.numel() == 0:
        return torch.zeros_like(rows), torch.zeros_like(rows, dtype=torch.bool)
    where = torch.searchsorted(sorted_rows, rows).clamp_(max=sorted_rows.numel() - 1)
    return where, sorted_rows[where] == rows

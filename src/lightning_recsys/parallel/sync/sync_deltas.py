"""One replica sync in flight: the gathered rows, their all-reduces, and how the average is applied.

A sync sends, per synced tensor, either the rows' values (``fp32``) or their change since the last
sync, ``row - base`` (deltas: ``bf16``, or count-aware averaging). The sums come back from an
all-reduce over the replica group (asynchronous with overlap) and every replica writes

    synced = average(values)                 (values)
    synced = base + average(deltas)          (deltas; base is equal on every replica)

With overlap the rows may have changed since they were sent; the change is kept:
``row = synced + (row_now - sent)``. A row nobody changed meanwhile gets exactly ``synced``.
With ``pieces`` > 1 the all-reduces start in that many shares, the first at launch and one per
``progress()``, so no step's dense all-reduce queues behind the whole sync on a shared link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_recsys.parallel.sync.touched_rows import Table

MIN_PIECE_BYTES = 64 * 1024  # an overlapped sync's smallest share or piece: less is not worth a collective of its own


def piece_count(total_bytes: int, max_pieces: int) -> int:
    """How many pieces an overlapped sync of ``total_bytes`` goes out in: up to ``max_pieces``, each at least ``MIN_PIECE_BYTES``."""
    return max(1, min(max_pieces, total_bytes // MIN_PIECE_BYTES))


@dataclass
class SyncItem:
    """One synced tensor's part of a sync."""

    tensor: torch.Tensor
    rows: Optional[torch.Tensor]  # sorted table-local rows; None: the whole tensor
    send: Optional[torch.Tensor]  # what goes into the all-reduce (values or deltas, maybe bf16); None: tensor[rows], gathered there
    base: Optional[torch.Tensor] = None  # deltas: the rows' values as of the last sync
    sent: Optional[torch.Tensor] = None  # overlap: the rows' values when the sync was launched
    counts: Optional[torch.Tensor] = None  # count-aware: how many replicas touched each row
    table: Optional[Table] = None  # overlap with deltas: the table whose captured bases need the synced value
    index: int = 0  # the tensor's position in ``table.tensors``


class InFlightSync:
    """The all-reduces of one sync, launched; ``apply()`` waits for them and writes the average."""

    def __init__(
        self,
        items: list[SyncItem],
        group: dist.ProcessGroup,
        num_replicas: int,
        *,
        bucket_bytes: int,
        async_op: bool,
        pieces: int = 1,
    ) -> None:
        """``pieces`` (with ``async_op``): start the all-reduces in up to this many shares of at least
        ``MIN_PIECE_BYTES``, the first now and one per ``progress()`` call; ``wait()`` starts what is left."""
        if pieces < 1 or (pieces > 1 and not async_op):
            raise ValueError(f"pieces={pieces}: must be 1, or more with async_op=True")
        self._num_replicas = num_replicas
        self._group = group
        self.payload_bytes = 0
        self._groups: list[tuple[list[SyncItem], torch.Tensor]] = []
        self._works: list[Any] = []
        chunks: list[torch.Tensor] = []
        by_dtype: dict[torch.dtype, list[SyncItem]] = {}
        for item in items:
            by_dtype.setdefault(item.tensor.dtype if item.send is None else item.send.dtype, []).append(item)
        for dtype, dtype_items in by_dtype.items():
            sizes = [_numel(item) for item in dtype_items]
            flat = torch.empty(sum(sizes), dtype=dtype, device=dtype_items[0].tensor.device)
            for item, piece in zip(dtype_items, flat.split(sizes)):
                if item.send is None:
                    assert item.rows is not None
                    torch.index_select(item.tensor, 0, item.rows, out=piece.view(-1, *item.tensor.shape[1:]))
                else:
                    piece.copy_(item.send.reshape(-1))
                item.send = None  # the flat buffer holds it now; drop the extra copy
            chunks += flat.split(max(1, bucket_bytes // flat.element_size()))
            self.payload_bytes += flat.numel() * flat.element_size()
            self._groups.append((dtype_items, flat))
        self._shares = _split_shares(chunks, pieces)  # every replica has the same items, so the same shares
        self._async_op = async_op
        self.shares_started = 0
        self._start_share()
        if not async_op:
            while self._shares:
                self._start_share()

    def progress(self) -> None:
        """Start the next share of the all-reduces (``pieces``); every replica calls it at the same points."""
        if self._shares:
            self._start_share()

    def _start_share(self) -> None:
        self.shares_started += 1
        for chunk in self._shares.pop(0) if self._shares else []:
            work = dist.all_reduce(chunk, group=self._group, async_op=self._async_op)
            if self._async_op:
                self._works.append(work)

    def wait(self) -> None:
        """Start what is left, then wait for the collectives (raises if a peer failed or the group timed out)."""
        while self._shares:
            self._start_share()
        works, self._works = self._works, []
        for work in works:
            work.wait()

    @torch.no_grad()
    def apply(self) -> None:
        """Wait, then write every item's average (keeping changes made since the launch)."""
        self.wait()
        for items, flat in self._groups:
            offset = 0
            for item in items:
                t = item.tensor
                shape = t.shape if item.rows is None else torch.Size((item.rows.numel(), *t.shape[1:]))
                n = shape.numel()
                summed = flat[offset : offset + n].view(shape)
                offset += n
                average = summed.to(t.dtype)  # the flat buffer (or its upcast copy) is ours: work on it in place
                if item.counts is not None:
                    average.div_(item.counts.to(t.dtype).view(-1, *([1] * (t.dim() - 1))))
                else:
                    average.div_(self._num_replicas)
                synced = average if item.base is None else average.add_(item.base)
                if item.sent is not None:
                    current = t.clone() if item.rows is None else t.index_select(0, item.rows)
                    new = current.sub_(item.sent).add_(synced)
                    if item.table is not None and item.rows is not None:
                        item.table.rebase(item.index, item.rows, synced)
                else:
                    new = synced
                if item.rows is None:
                    t.copy_(new)
                else:
                    t.index_copy_(0, item.rows, new)
        self._groups = []


def _split_shares(chunks: list[torch.Tensor], pieces: int) -> list[list[torch.Tensor]]:
    """``chunks`` (1-D) cut into up to ``pieces`` shares of about equal bytes, each at least ``MIN_PIECE_BYTES``."""
    total = sum(c.numel() * c.element_size() for c in chunks)
    count = piece_count(total, pieces)
    target = -(-total // count)
    shares: list[list[torch.Tensor]] = [[]]
    room = target
    for chunk in chunks:
        while chunk.numel():
            if room <= 0:
                shares.append([])
                room = target
            take = min(chunk.numel(), max(1, room // chunk.element_size()))
            shares[-1].append(chunk[:take])
            room -= take * chunk.element_size()
            chunk = chunk[take:]
    return [share for share in shares if share]


def _numel(item: SyncItem) -> int:
    if item.send is not None:
        return item.send.numel()
    return item.tensor.numel() if item.rows is None else item.rows.numel() * item.tensor[0].numel()


def table_items(
    table: Table,
    rows: torch.Tensor,
    *,
    deltas: bool,
    weight_dtype: Optional[torch.dtype],
    overlap: bool,
    counts: Optional[torch.Tensor],
) -> list[SyncItem]:
    """The items syncing ``rows`` of ``table`` (weights first, then optimizer state); takes its captured bases."""
    captured, captured_values = table.take_bases() if deltas else (None, None)
    items = []
    for index, t in enumerate(table.tensors):
        if not deltas and not overlap:  # the values go straight from the table into the send buffer
            items.append(SyncItem(t, rows, None, counts=counts, index=index))
            continue
        current = t.index_select(0, rows)
        base = None
        send = current
        if deltas:
            assert captured is not None and captured_values is not None
            base = current.clone()  # rows this replica did not touch: their delta is 0
            if captured.numel():
                base[torch.searchsorted(rows, captured)] = captured_values[index]
            send = current - base
            if index == 0 and weight_dtype is not None:
                send = send.to(weight_dtype)  # the weights' deltas travel compressed; optimizer state in its own dtype
        items.append(
            SyncItem(
                t, rows, send, base=base, sent=current if overlap else None, counts=counts,
                table=table if overlap and deltas else None, index=index,
            )
        )
    return items


def whole_tensor_items(tensors: list[torch.Tensor]) -> list[SyncItem]:
    """Overlapped whole-tensor averaging: each tensor's values as sent (two copies in memory until applied)."""
    items = []
    for t in tensors:
        sent = t.detach().clone()
        items.append(SyncItem(t, None, sent, sent=sent))
    return items

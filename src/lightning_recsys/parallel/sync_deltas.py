"""One replica sync in flight: the gathered rows, their all-reduces, and how the average is applied.

A sync sends, per synced tensor, either the rows' values (``fp32``) or their change since the last
sync, ``row - base`` (deltas: ``bf16``, or count-aware averaging). The sums come back from an
all-reduce over the replica group (asynchronous with overlap) and every replica writes

    synced = average(values)                 (values)
    synced = base + average(deltas)          (deltas; base is equal on every replica)

With overlap the rows may have changed since they were sent; the change is kept:
``row = synced + (row_now - sent)``. A row nobody changed meanwhile gets exactly ``synced``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_recsys.parallel.touched_rows import Table


@dataclass
class SyncItem:
    """One synced tensor's part of a sync."""

    tensor: torch.Tensor
    rows: Optional[torch.Tensor]  # sorted table-local rows; None: the whole tensor
    send: torch.Tensor  # what goes into the all-reduce (values or deltas, maybe bf16)
    base: Optional[torch.Tensor] = None  # deltas: the rows' values as of the last sync
    sent: Optional[torch.Tensor] = None  # overlap: the rows' values when the sync was launched
    counts: Optional[torch.Tensor] = None  # count-aware: how many replicas touched each row
    table: Optional[Table] = None  # overlap with deltas: the table whose captured bases need the synced value
    index: int = 0  # the tensor's position in ``table.tensors``


class InFlightSync:
    """The all-reduces of one sync, launched; ``apply()`` waits for them and writes the average."""

    def __init__(
        self, items: list[SyncItem], group: dist.ProcessGroup, num_replicas: int, *, bucket_bytes: int, async_op: bool
    ) -> None:
        self._num_replicas = num_replicas
        self.payload_bytes = 0
        self._groups: list[tuple[list[SyncItem], torch.Tensor]] = []
        self._works: list[Any] = []
        by_dtype: dict[torch.dtype, list[SyncItem]] = {}
        for item in items:
            by_dtype.setdefault(item.send.dtype, []).append(item)
        for dtype_items in by_dtype.values():
            flat = torch.cat([item.send.reshape(-1) for item in dtype_items])
            for item in dtype_items:
                item.send = flat[:0]  # the flat buffer holds it now; drop the extra copy
            chunk = max(1, bucket_bytes // flat.element_size())
            for piece in flat.split(chunk):
                work = dist.all_reduce(piece, group=group, async_op=async_op)
                if async_op:
                    self._works.append(work)
            self.payload_bytes += flat.numel() * flat.element_size()
            self._groups.append((dtype_items, flat))

    def wait(self) -> None:
        """Wait for the collectives (raises if a peer failed or the group timed out)."""
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
                summed = flat[offset : offset + n].view(shape).to(t.dtype)
                offset += n
                if item.counts is not None:
                    average = summed / item.counts.to(t.dtype).view(-1, *([1] * (t.dim() - 1)))
                else:
                    average = summed / self._num_replicas
                synced = average if item.base is None else item.base + average
                if item.sent is not None:
                    current = t if item.rows is None else t.index_select(0, item.rows)
                    new = synced + (current - item.sent)
                    if item.table is not None and item.rows is not None:
                        item.table.rebase(item.index, item.rows, synced)
                else:
                    new = synced
                if item.rows is None:
                    t.copy_(new)
                else:
                    t.index_copy_(0, item.rows, new)
        self._groups = []


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

"""Keeping the replicas of the sharded tables in step: average over the replica group."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.optim.keyed import KeyedOptimizer

from lightning_recsys.parallel.comms import comm_purpose
from lightning_recsys.parallel.step_phases import REPLICA_SYNC_APPLY, REPLICA_SYNC_EXCHANGE, REPLICA_SYNC_LAUNCH, step_phase
from lightning_recsys.parallel.sync.replica_sync_config import ReplicaSyncConfig
from lightning_recsys.parallel.sync.sync_deltas import InFlightSync, SyncItem, table_items, whole_tensor_items
from lightning_recsys.parallel.sync.sync_gather import GatheredSync
from lightning_recsys.parallel.sync.touched_rows import RowTracker, bits_at, fused_kernels, pack_positions, track, unpack_positions

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class SyncStats:
    """What one replica sync moved, on this rank.

    ``rows_synced`` rows (of ``rows_total`` local shard rows) were averaged: the union of the rows
    touched since the last sync under ``rows="touched"``, every row under ``rows="all"``. ``union``
    says how the replicas agreed on it (``"bitmap"``: an all-gather of 1-bit row masks,
    ``"indices"``: an all-gather of the touched row ids, ``"none"``: nothing touched anywhere,
    ``"all"``: whole shards, ``"gather"``: none, each replica all-gathered its own touched rows).
    ``payload_bytes`` is what this rank handed to the collectives.
    ``overlapped``: launched in the background and applied at the end of the interval's last step
    (just before the next sync), or by a forced sync.
    """

    rows_synced: int
    rows_total: int
    union: str
    payload_bytes: int
    overlapped: bool = False

    @property
    def touched_fraction(self) -> float:
        return self.rows_synced / self.rows_total if self.rows_total else 0.0


@dataclass(frozen=True)
class SyncTotals:
    """All replica syncs of this synchronizer so far, on this rank (for run summaries)."""

    syncs: int
    rows_synced: int
    rows_total: int  # local shard rows
    payload_bytes: int

    @property
    def rows_per_sync(self) -> float:
        return self.rows_synced / self.syncs if self.syncs else 0.0

    @property
    def touched_fraction(self) -> float:
        return self.rows_per_sync / self.rows_total if self.rows_total else 0.0

    @property
    def bytes_per_sync(self) -> float:
        return self.payload_bytes / self.syncs if self.syncs else 0.0


class ReplicaSynchronizer:
    """Averages this rank's embedding shards (and optionally the fused optimizer state) over its replicas.

    Right after a sync every replica is identical, and a row no replica looked up since is still
    identical everywhere. So under ``ReplicaSyncConfig(rows="touched")`` (the default) only the union
    over the replica group of the rows looked up since the last sync is averaged: weights and
    row-aligned optimizer state, gathered into one buffer per dtype, all-reduced (SUM, then divided by
    the replica count) and scattered back. The result equals whole-shard averaging (bit for bit with
    2 replicas). ``rows="all"`` averages whole shards, one all-reduce per bucket of at most
    ``bucket_bytes`` (tensors of one dtype flattened together). Either way every replica ends with
    bit-identical values. Data-parallel tables are not included: DDP already keeps them equal on all
    ranks.

    ``precision="bf16"`` sends each touched row's change since the last sync, ``row - base``, in
    bf16 (``base``: the row's values at its first lookup since the last sync, copied by the forward
    pre-hook before the fused update; memory O(rows touched)); every replica then sets
    ``row = base + average(delta)``, so replicas stay bit-identical and rounding hits only the
    change. The optimizer-state rows travel as fp32 deltas.

    ``overlap=True``: the union is agreed at the end of the step (two small blocking collectives:
    the largest touched count, then the row ids or bitmaps), the rows are copied into the send
    buffers, and their all-reduce is launched asynchronously (gloo runs it on its own threads; nccl
    on its own stream) while training goes on. It has the whole interval to complete: at the end of
    the interval's last step, just before the next sync, it is applied,
    ``row = average(sent) + (row - sent)``, so the updates made meanwhile are kept and the next sync
    averages them. So the tables see each average ``every_n_steps`` steps late (one step with
    ``every_n_steps=1``), and replicas are identical right after the apply on every row not updated
    meanwhile. Memory: the union's rows twice (sent values and the buffer), O(rows touched); with
    ``rows="all"`` twice the shard. Forced syncs (``sync``, ``sync_if_pending``) first apply a sync
    in flight, then sync blocking.

    ``exchange="all_gather"`` (``sync_gather.GatheredSync``): no union agreement; every replica
    all-gathers the rows it touched with their changes since the last sync and adds them up in
    replica order. Overlapped, its stats are recorded when it is applied.

    ``count_aware=True`` (``ReplicaSyncConfig.average`` resolved to ``"touching_replicas"`` by
    ``averages_over_touching_replicas``; sends deltas): a row's summed delta is divided by the
    number of replicas that touched it, not by all replicas.

    It owns its cadence: call ``step_ended()`` after every training step (it syncs every
    ``every_n_steps``), ``sync_if_pending()`` before evaluation and saves, ``sync()`` to force one.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        replica_group: dist.ProcessGroup,
        *,
        config: Optional[ReplicaSyncConfig] = None,
        kernels: Optional[list[nn.Module]] = None,
        rows_total: Optional[int] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        count_aware: bool = False,
        own_state: Optional[list[torch.Tensor]] = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1.")
        self.config = config or ReplicaSyncConfig()
        if count_aware and self.config.rows != "touched":
            raise ValueError("count_aware=True needs ReplicaSyncConfig(rows='touched'): it divides by the replicas that touched a row.")
        self.count_aware = count_aware
        self._deltas = self.config.sends_deltas or count_aware
        self._gather = self.config.exchange == "all_gather"
        self._weight_dtype = torch.bfloat16 if self.config.precision == "bf16" else None
        self._tensors = _unique_floating(tensors)
        self._group = replica_group
        self._num_replicas = dist.get_world_size(replica_group)
        self._bucket_bytes = bucket_bytes
        self._buckets = _buckets(self._tensors, bucket_bytes)
        # Kept per replica between saves (optimizer_state=False); averaged only by average_own_state().
        self._own_state_buckets = _buckets(_unique_floating(own_state or []), bucket_bytes)
        # Local table rows (the weights' rows); by default every 2-D tensor counts as a weight.
        self._rows_total = rows_total if rows_total is not None else sum(int(t.shape[0]) for t in self._tensors if t.dim() == 2)
        self._trackers: list[RowTracker] = []
        self._untracked: list[torch.Tensor] = list(self._tensors)
        if self.config.rows == "touched":
            # The all-gather needs no row order: its trackers skip the sorts (most of the tracking's CPU).
            self._trackers, self._untracked = track(self._tensors, kernels or [], capture_bases=self._deltas, sorted_pieces=not self._gather)
        self._untracked_buckets = _buckets(self._untracked, bucket_bytes)
        self._rows_untracked = self._rows_total - sum(table.rows for tracker in self._trackers for table in tracker.tables)
        self._tracked_rows = sum(int(tracker.mask.numel()) for tracker in self._trackers)  # the masks end to end
        self._in_flight: list[InFlightSync | GatheredSync] = []
        self._pending_stats: Optional[SyncStats] = None  # an overlapped all-gather's, until applied
        self.steps_since_sync = 0
        self.last_sync_stats: Optional[SyncStats] = None
        self.num_syncs = 0
        self._rows_synced_sum = 0
        self._payload_sum = 0

    @classmethod
    def for_sharded_modules(
        cls,
        modules: list[nn.Module],
        fused_optimizer: KeyedOptimizer,
        replica_group: dist.ProcessGroup,
        *,
        config: Optional[ReplicaSyncConfig] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        count_aware: bool = False,
    ) -> ReplicaSynchronizer:
        """Synchronize the local shards of ``modules``' sharded tables and of the fused optimizer's state."""
        config = config or ReplicaSyncConfig()
        tensors = [t for module in modules for t in _local_shard_tensors(module.state_dict().values())]
        rows_total = sum(int(t.shape[0]) for t in _unique_floating(tensors))
        state = [t for param_state in fused_optimizer.state.values() for t in _local_shard_tensors(param_state.values())]
        if config.optimizer_state:
            tensors += state
        kernels = fused_kernels(modules)
        return cls(
            tensors, replica_group, config=config, kernels=kernels, rows_total=rows_total, bucket_bytes=bucket_bytes,
            count_aware=count_aware, own_state=None if config.optimizer_state else state,
        )

    @property
    def payload_bytes(self) -> int:
        """Bytes of a whole-shard sync."""
        return sum(t.numel() * t.element_size() for t in self._tensors)

    @property
    def tracks_rows(self) -> bool:
        """Whether any table's touched rows are tracked (``rows="touched"`` with fused kernels)."""
        return bool(self._trackers)

    @property
    def in_flight(self) -> bool:
        """Whether an overlapped sync was launched and not applied yet."""
        return bool(self._in_flight)

    @property
    def totals(self) -> SyncTotals:
        return SyncTotals(self.num_syncs, self._rows_synced_sum, self._rows_total, self._payload_sum)

    # ------------------------------------------------------------------ cadence
    def step_ended(self) -> bool:
        """A training step ended: apply a sync in flight; sync if ``every_n_steps`` steps ran since the last one.

        Returns whether a sync was started."""
        with comm_purpose("replica_sync"), step_phase(REPLICA_SYNC_EXCHANGE):
            for part in self._in_flight:
                part.progress()  # the next piece of an overlapped sync goes out a step after the last
        self.steps_since_sync += 1
        if self.steps_since_sync >= self.config.every_n_steps:
            self._finish()  # an overlapped sync had the whole interval to complete
            self._run(overlap=self.config.overlap)
            return True
        return False

    def sync_if_pending(self) -> bool:
        """Apply a sync in flight, then sync (blocking) if a step ran since the last one. Returns whether it synced."""
        self._finish()
        if self.steps_since_sync:
            self._run(overlap=False)
            return True
        return False

    @torch.no_grad()
    def average_own_state(self) -> None:
        """Average, blocking, what each replica otherwise keeps its own: the fused optimizer state under
        ``ReplicaSyncConfig(optimizer_state=False)`` (a no-op otherwise). Before a checkpoint save: one replica
        writes it and every replica resumes from it, so all must hold it. Every replica must call it."""
        if self._own_state_buckets:
            with comm_purpose("replica_sync"):
                self._all_reduce_buckets(self._own_state_buckets)

    def reset(self) -> None:
        """Forget the steps and touched rows since the last sync (after every replica loaded the same state)."""
        for part in self._in_flight:
            part.wait()  # every replica takes part in the collective; its result is stale now
        self._in_flight, self._pending_stats = [], None
        self.steps_since_sync = 0
        for tracker in self._trackers:
            tracker.clear()

    def close(self) -> None:
        """Remove the row-tracking hooks (a sync still in flight is dropped: call ``sync_if_pending`` first)."""
        self._in_flight, self._pending_stats = [], None
        for tracker in self._trackers:
            tracker.remove()
        self._trackers = []

    # ------------------------------------------------------------------ the sync
    def sync(self) -> None:
        """Apply a sync in flight, then average over the replica group now, blocking (every replica must call it)."""
        self._finish()
        self._run(overlap=False)

    def _finish(self) -> None:
        parts, self._in_flight = self._in_flight, []
        with comm_purpose("replica_sync"), step_phase(REPLICA_SYNC_APPLY):  # a deferred exchange not started yet starts here
            for part in parts:
                part.apply()
        gathered = [part for part in parts if isinstance(part, GatheredSync)]
        if self._pending_stats is not None:
            stats, self._pending_stats = self._pending_stats, None
            self._record(dataclasses.replace(
                stats, rows_synced=stats.rows_synced + sum(p.rows_synced for p in gathered),
                payload_bytes=stats.payload_bytes + sum(p.deferred_payload_bytes for p in gathered),
            ))

    @torch.no_grad()
    def _run(self, *, overlap: bool) -> None:
        with comm_purpose("replica_sync"), step_phase(REPLICA_SYNC_LAUNCH):
            if self.config.rows == "all" and not overlap:
                self._all_reduce_buckets(self._buckets)
                stats = SyncStats(self._rows_total, self._rows_total, "all", self.payload_bytes)
            else:
                stats = self._launch(overlap)
        self.steps_since_sync = 0
        if self._gather and overlap and self._trackers:
            self._pending_stats = stats  # the union's size is known once applied
        else:
            self._record(stats)

    def _record(self, stats: SyncStats) -> None:
        self.last_sync_stats = stats
        self.num_syncs += 1
        self._rows_synced_sum += stats.rows_synced
        self._payload_sum += stats.payload_bytes

    def _all_reduce_buckets(self, buckets: list[list[torch.Tensor]]) -> None:
        for bucket in buckets:
            flat = _flatten(bucket)
            dist.all_reduce(flat, group=self._group)
            flat.div_(self._num_replicas)
            _unflatten_into(flat, bucket)

    def _launch(self, overlap: bool) -> SyncStats:
        """Gather what this sync averages and start its all-reduces (applied now, or later with ``overlap``)."""
        whole = self._tensors if self.config.rows == "all" else self._untracked
        items: list[SyncItem] = []
        payload = 0
        if overlap:
            items += whole_tensor_items(whole)
        else:
            payload += sum(t.numel() * t.element_size() for t in whole)
            self._all_reduce_buckets(self._buckets if self.config.rows == "all" else self._untracked_buckets)
        rows_synced = self._rows_total if self.config.rows == "all" else self._rows_untracked
        how = "all"
        gathered: Optional[GatheredSync] = None
        if self._trackers and self._gather:
            gathered = self._gather_touched(overlap)
            payload += gathered.payload_bytes
            how = "gather"
        elif self._trackers:
            union, how, union_bytes, counts = self._union(self._touched(), self._tracked_rows, with_counts=self.count_aware)
            payload += union_bytes
            rows_synced += int(union.numel())
            items += self._table_items(union, counts, overlap)
            for tracker in self._trackers:
                tracker.clear()  # a new interval starts: later lookups (and captured bases) belong to the next sync
        in_flight = InFlightSync(
            items, self._group, self._num_replicas, bucket_bytes=self._bucket_bytes, async_op=overlap,
            pieces=self.config.every_n_steps if overlap else 1,  # one share now, one at each of the interval's other step ends
        )
        payload += in_flight.payload_bytes
        parts: list[InFlightSync | GatheredSync] = [in_flight] if gathered is None else [in_flight, gathered]
        if overlap:
            self._in_flight = parts
        else:
            with step_phase(REPLICA_SYNC_APPLY):
                for part in parts:
                    part.apply()
            rows_synced += gathered.rows_synced if gathered is not None else 0
        return SyncStats(rows_synced, self._rows_total, how, payload, overlapped=overlap)

    def _gather_touched(self, overlap: bool) -> GatheredSync:
        """Launch the all-gather of this replica's touched rows and their changes (``exchange="all_gather"``)."""
        tables, rows = [], []
        for tracker in self._trackers:
            for table in tracker.tables:
                # A delta sync captured every touched row's base at first touch: those rows are the touched rows.
                tables.append(table)
                rows.append(table.bases(sort=False)[0])
        defer = overlap and self.config.every_n_steps > 1
        gathered = GatheredSync(
            tables, rows, self._group, self._num_replicas, weight_precision=self.config.precision, overlap=overlap,
            count_aware=self.count_aware,
            # Sizing the buffers waits on the network; with an interval of 2 or more steps that wait moves a step later,
            # and the changes travel in a piece per remaining step, so no step's dense all-reduce queues behind all of them.
            defer_exchange=defer, exchange_pieces=self.config.every_n_steps - 1 if defer else 1,
        )
        for tracker in self._trackers:
            tracker.clear()  # a new interval starts (the bases were taken)
        return gathered

    def _touched(self) -> torch.Tensor:
        """This rank's touched rows as sorted positions in the trackers' masks laid end to end."""
        pieces, start = [], 0
        for tracker in self._trackers:
            pieces.append(tracker.touched() + start)
            start += tracker.mask.numel()
        return torch.cat(pieces)

    def _table_items(self, union: torch.Tensor, counts: Optional[torch.Tensor], overlap: bool) -> list[SyncItem]:
        items: list[SyncItem] = []
        start = 0
        for tracker in self._trackers:
            for table, lo, hi in tracker.split(union, start):
                items += table_items(
                    table, union[lo:hi] - (start + table.offset), deltas=self._deltas, weight_dtype=self._weight_dtype,
                    overlap=overlap, counts=counts[lo:hi] if counts is not None else None,
                )
            start += tracker.mask.numel()
        return items

    def _union(
        self, local: torch.Tensor, total: int, *, with_counts: bool = False
    ) -> tuple[torch.Tensor, str, int, Optional[torch.Tensor]]:
        """The sorted union over the replica group of the sorted positions ``local`` (all < ``total``); how; bytes
        sent; per row, how many replicas touched it (``with_counts``). The work is O(rows touched) but for the
        bitmap's bytes (total / 8), which it only uses when they are fewer than the touched rows' ids."""
        count = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._group)
        sent = count.numel() * count.element_size()
        most = int(count.item())
        if most == 0:
            empty = torch.empty(0, dtype=torch.long, device=local.device)
            return empty, "none", sent, empty if with_counts else None
        index_dtype = torch.int32 if total < 2**31 else torch.int64
        index_bytes = most * index_dtype.itemsize
        bitmap_bytes = (total + 7) // 8
        if index_bytes < bitmap_bytes:  # few rows: gather their ids, padded to the longest list with `total`
            padded = torch.full((most,), total, dtype=index_dtype, device=local.device)
            padded[: local.numel()] = local
            gathered = [torch.empty_like(padded) for _ in range(self._num_replicas)]
            dist.all_gather(gathered, padded, group=self._group)
            ids = torch.cat(gathered)
            ids = ids[ids < total]  # sorted in index_dtype: int32 sorts faster than int64
            if with_counts:
                union, counts = torch.unique(ids, return_counts=True)
                return union.long(), "indices", sent + index_bytes, counts
            return torch.unique(ids).long(), "indices", sent + index_bytes, None
        packed = pack_positions(local, total)
        gathered = [torch.empty_like(packed) for _ in range(self._num_replicas)]
        dist.all_gather(gathered, packed, group=self._group)
        merged = gathered[0].clone()
        for bits in gathered[1:]:
            merged.bitwise_or_(bits)
        union = unpack_positions(merged)
        counts = torch.stack([bits_at(bits, union) for bits in gathered]).sum(0) if with_counts else None
        return union, "bitmap", sent + packed.numel(), counts

    @torch.no_grad()
    def broadcast_from_first_replica(self) -> None:
        """Make every replica a copy of the first one (used once after sharding, so replicas start equal)."""
        self.reset()
        with comm_purpose("replica_sync"):
            for bucket in self._buckets:
                flat = _flatten(bucket)
                dist.broadcast(flat, group=self._group, group_src=0)
                _unflatten_into(flat, bucket)
        self.reset()


def _flatten(bucket: list[torch.Tensor]) -> torch.Tensor:
    if len(bucket) == 1 and bucket[0].is_contiguous():
        return bucket[0]  # in place, no copy
    return torch.cat([t.reshape(-1) for t in bucket])


def _unflatten_into(flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    if len(bucket) == 1 and flat is bucket[0]:
        return
    offset = 0
    for t in bucket:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _local_shard_tensors(values: object) -> list[torch.Tensor]:
    return [shard.tensor for v in values if isinstance(v, ShardedTensor) for shard in v.local_shards()]  # type: ignore[attr-defined]


def _unique_floating(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[tuple[int, int, torch.dtype]] = set()
    unique: list[torch.Tensor] = []
    for t in tensors:
        key = (t.data_ptr(), t.numel(), t.dtype)
        # Integer state (step counters) is equal on every replica already; averaging it would truncate.
        if t.numel() == 0 or not t.is_floating_point() or key in seen:
            continue
        seen.add(key)
        unique.append(t)
    return unique


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    buckets: list[list[torch.Tensor]] = []
    for t in tensors:
        size = t.numel() * t.element_size()
        bucket, used = open_buckets.get((t.dtype, t.device), ([], 0))
        if bucket and used + size > bucket_bytes:
            bucket, used = [], 0
        if not bucket:
            buckets.append(bucket)
        bucket.append(t)
        open_buckets[(t.dtype, t.device)] = (bucket, used + size)
    return buckets

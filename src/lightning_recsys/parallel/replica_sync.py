"""Keeping the replicas of the sharded tables in step: average over the replica group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbedding, BatchedFusedEmbeddingBag
from torchrec.optim.keyed import KeyedOptimizer

from lightning_recsys.parallel.comm_accounting import comm_purpose
from lightning_recsys.parallel.replica_sync_config import ReplicaSyncConfig

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class SyncStats:
    """What one replica sync moved, on this rank.

    ``rows_synced`` rows (of ``rows_total`` local shard rows) were averaged: the union of the rows
    touched since the last sync under ``rows="touched"``, every row under ``rows="all"``. ``union``
    says how the replicas agreed on it (``"bitmap"``: an all-gather of 1-bit row masks,
    ``"indices"``: an all-gather of the touched row ids, ``"none"``: nothing touched anywhere,
    ``"all"``: whole shards). ``payload_bytes`` is what this rank handed to the collectives.
    """

    rows_synced: int
    rows_total: int
    union: str
    payload_bytes: int

    @property
    def touched_fraction(self) -> float:
        return self.rows_synced / self.rows_total if self.rows_total else 0.0


@dataclass
class _Table:
    """One local shard of one table inside a fused kernel: its rows in the kernel's mask."""

    offset: int  # first row in the kernel's mask
    rows: int
    tensors: list[torch.Tensor]  # the weight [rows, dim] and the row-aligned optimizer state ([rows] or [rows, dim])


class _TouchedRows:
    """Marks the local rows each fused kernel looks up (1 byte per local row), from a forward pre-hook.

    The hook sees the ``KeyedJaggedTensor`` a kernel receives after TorchRec's input distribution:
    its ids are row numbers of the kernel's local shards already (table_wise: the table's rows;
    row_wise: bucketized to the shard's block, offset removed; column_wise / table_column_wise: every
    column shard holds all rows and gets the full ids). Key ``i`` belongs to table
    ``kernel._feature_table_map[i]``. Ids out of a table's range mark row 0, the row FBGEMM's bounds
    check clamps them to.
    """

    def __init__(self, module: nn.Module, tables: list[_Table], row_counts: list[int]) -> None:
        self.tables = tables
        device = tables[0].tensors[0].device
        offsets = [0]
        for rows in row_counts:
            offsets.append(offsets[-1] + rows)
        feature_table = torch.tensor(list(module._feature_table_map), dtype=torch.long)  # type: ignore[attr-defined]
        self._num_features = int(feature_table.numel())
        self._feature_rows = torch.tensor(row_counts, dtype=torch.long)[feature_table].to(device)
        self._feature_offsets = torch.tensor(offsets[:-1], dtype=torch.long)[feature_table].to(device)
        self.mask = torch.zeros(offsets[-1], dtype=torch.bool, device=device)
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
        self.mask[self._feature_offsets[feature] + torch.where(valid, ids, torch.zeros_like(ids))] = True

    def remove(self) -> None:
        self._handle.remove()


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
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1.")
        self.config = config or ReplicaSyncConfig()
        self._tensors = _unique_floating(tensors)
        self._group = replica_group
        self._num_replicas = dist.get_world_size(replica_group)
        self._bucket_bytes = bucket_bytes
        self._buckets = _buckets(self._tensors, bucket_bytes)
        # Local table rows (the weights' rows); by default every 2-D tensor counts as a weight.
        self._rows_total = rows_total if rows_total is not None else sum(int(t.shape[0]) for t in self._tensors if t.dim() == 2)
        self._trackers: list[_TouchedRows] = []
        self._untracked: list[torch.Tensor] = list(self._tensors)
        if self.config.rows == "touched":
            self._trackers, self._untracked = _track(self._tensors, kernels or [])
        self._untracked_buckets = _buckets(self._untracked, bucket_bytes)
        self._rows_untracked = self._rows_total - sum(table.rows for tracker in self._trackers for table in tracker.tables)
        self.steps_since_sync = 0
        self.last_sync_stats: Optional[SyncStats] = None
        self.num_syncs = 0

    @classmethod
    def for_sharded_modules(
        cls,
        modules: list[nn.Module],
        fused_optimizer: KeyedOptimizer,
        replica_group: dist.ProcessGroup,
        *,
        config: Optional[ReplicaSyncConfig] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> ReplicaSynchronizer:
        """Synchronize the local shards of ``modules``' sharded tables and of the fused optimizer's state."""
        config = config or ReplicaSyncConfig()
        tensors = [t for module in modules for t in _local_shard_tensors(module.state_dict().values())]
        rows_total = sum(int(t.shape[0]) for t in _unique_floating(tensors))
        if config.optimizer_state:
            tensors += [t for state in fused_optimizer.state.values() for t in _local_shard_tensors(state.values())]
        kernels = _fused_kernels(modules)
        return cls(tensors, replica_group, config=config, kernels=kernels, rows_total=rows_total, bucket_bytes=bucket_bytes)

    @property
    def payload_bytes(self) -> int:
        """Bytes of a whole-shard sync."""
        return sum(t.numel() * t.element_size() for t in self._tensors)

    @property
    def tracks_rows(self) -> bool:
        """Whether any table's touched rows are tracked (``rows="touched"`` with fused kernels)."""
        return bool(self._trackers)

    # ------------------------------------------------------------------ cadence
    def step_ended(self) -> bool:
        """A training step ended; sync if ``every_n_steps`` steps ran since the last one. Returns whether it synced."""
        self.steps_since_sync += 1
        if self.steps_since_sync >= self.config.every_n_steps:
            self.sync()
            return True
        return False

    def sync_if_pending(self) -> bool:
        """Sync if a step ran since the last sync (before evaluation, saves, the end of training)."""
        if self.steps_since_sync:
            self.sync()
            return True
        return False

    def reset(self) -> None:
        """Forget the steps and touched rows since the last sync (after every replica loaded the same state)."""
        self.steps_since_sync = 0
        for tracker in self._trackers:
            tracker.mask.zero_()

    def close(self) -> None:
        """Remove the row-tracking hooks."""
        for tracker in self._trackers:
            tracker.remove()
        self._trackers = []

    # ------------------------------------------------------------------ the sync
    @torch.no_grad()
    def sync(self) -> None:
        """Average over the replica group now (every replica must call it)."""
        with comm_purpose("replica_sync"):
            if self.config.rows == "all":
                self._all_reduce_buckets(self._buckets)
                stats = SyncStats(self._rows_total, self._rows_total, "all", self.payload_bytes)
            else:
                stats = self._sync_touched()
        self.steps_since_sync = 0
        self.last_sync_stats = stats
        self.num_syncs += 1

    def _all_reduce_buckets(self, buckets: list[list[torch.Tensor]]) -> None:
        for bucket in buckets:
            flat = _flatten(bucket)
            dist.all_reduce(flat, group=self._group)
            flat.div_(self._num_replicas)
            _unflatten_into(flat, bucket)

    def _sync_touched(self) -> SyncStats:
        payload = sum(t.numel() * t.element_size() for t in self._untracked)
        self._all_reduce_buckets(self._untracked_buckets)
        rows_untracked = self._rows_untracked
        if not self._trackers:
            return SyncStats(rows_untracked, self._rows_total, "all", payload)
        mask = torch.cat([tracker.mask for tracker in self._trackers])
        union, how, union_bytes = self._union(mask)
        payload += union_bytes
        # Gather the union's rows of every tensor, one buffer per dtype; average; scatter back.
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        start = 0
        for tracker in self._trackers:
            for table in tracker.tables:
                lo, hi = torch.searchsorted(union, torch.tensor([start + table.offset, start + table.offset + table.rows], device=union.device)).tolist()
                if hi > lo:
                    rows = union[lo:hi] - (start + table.offset)
                    plan += [(t, rows) for t in table.tensors]
            start += tracker.mask.numel()
        by_dtype: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for t, rows in plan:
            by_dtype.setdefault(t.dtype, []).append((t, rows))
        for dtype, items in by_dtype.items():
            flat = torch.cat([t.index_select(0, rows).reshape(-1) for t, rows in items])
            chunk = max(1, self._bucket_bytes // flat.element_size())
            for piece in flat.split(chunk):
                dist.all_reduce(piece, group=self._group)
            flat.div_(self._num_replicas)
            payload += flat.numel() * flat.element_size()
            offset = 0
            for t, rows in items:
                n = rows.numel() * (t.numel() // t.shape[0])
                t.index_copy_(0, rows, flat[offset : offset + n].view((rows.numel(), *t.shape[1:])))
                offset += n
        for tracker in self._trackers:
            tracker.mask.zero_()
        return SyncStats(rows_untracked + int(union.numel()), self._rows_total, how, payload)

    def _union(self, mask: torch.Tensor) -> tuple[torch.Tensor, str, int]:
        """The sorted union over the replica group of the rows set in ``mask``; how; bytes sent."""
        total = mask.numel()
        count = mask.sum().reshape(1).to(torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._group)
        sent = count.numel() * count.element_size()
        most = int(count.item())
        if most == 0:
            return torch.empty(0, dtype=torch.long, device=mask.device), "none", sent
        index_dtype = torch.int32 if total < 2**31 else torch.int64
        index_bytes = most * index_dtype.itemsize
        bitmap_bytes = (total + 7) // 8
        if index_bytes < bitmap_bytes:  # few rows: gather their ids, padded to the longest list with `total`
            local = mask.nonzero().squeeze(1).to(index_dtype)
            padded = torch.full((most,), total, dtype=index_dtype, device=mask.device)
            padded[: local.numel()] = local
            gathered = [torch.empty_like(padded) for _ in range(self._num_replicas)]
            dist.all_gather(gathered, padded, group=self._group)
            union_mask = torch.zeros(total + 1, dtype=torch.bool, device=mask.device)
            union_mask[torch.cat(gathered).long()] = True
            return union_mask[:total].nonzero().squeeze(1), "indices", sent + index_bytes
        packed = _pack_bits(mask)
        gathered = [torch.empty_like(packed) for _ in range(self._num_replicas)]
        dist.all_gather(gathered, packed, group=self._group)
        union_mask = torch.zeros_like(mask)
        for bits in gathered:
            union_mask |= _unpack_bits(bits, total)
        return union_mask.nonzero().squeeze(1), "bitmap", sent + packed.numel()

    @torch.no_grad()
    def broadcast_from_first_replica(self) -> None:
        """Make every replica a copy of the first one (used once after sharding, so replicas start equal)."""
        with comm_purpose("replica_sync"):
            for bucket in self._buckets:
                flat = _flatten(bucket)
                dist.broadcast(flat, group=self._group, group_src=0)
                _unflatten_into(flat, bucket)
        self.reset()


_FUSED_KERNELS = (BatchedFusedEmbeddingBag, BatchedFusedEmbedding)
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    return (padded.view(-1, 8) * _BITS.to(mask.device)).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, total: int) -> torch.Tensor:
    bits = packed.unsqueeze(1).bitwise_and(_BITS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:total]


def _fused_kernels(modules: list[nn.Module]) -> list[nn.Module]:
    """The fused TBE kernels of sharded EBC/EC modules (their lookups sit in a plain list, ``_lookups``)."""
    kernels: list[nn.Module] = []
    for module in modules:
        for sharded in module.modules():
            for lookup in getattr(sharded, "_lookups", None) or []:
                kernels += [m for m in lookup.modules() if isinstance(m, _FUSED_KERNELS) and all(m is not k for k in kernels)]
    return kernels


def _key(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
    return (t.data_ptr(), t.numel(), t.dtype)


def _track(tensors: list[torch.Tensor], kernels: list[nn.Module]) -> tuple[list[_TouchedRows], list[torch.Tensor]]:
    """Row trackers for the fused kernels' tables among ``tensors``; the tensors no tracker covers."""
    wanted = {_key(t): t for t in tensors}
    covered: set[tuple[int, int, torch.dtype]] = set()
    trackers: list[_TouchedRows] = []
    for kernel in kernels:
        weights = kernel.split_embedding_weights()  # type: ignore[operator]
        states = _optimizer_states(kernel)  # per table: FBGEMM's state views
        tables: list[_Table] = []
        offset = 0
        row_counts = []
        for index, weight in enumerate(weights):
            rows = int(weight.shape[0])
            row_counts.append(rows)
            table_tensors = [weight, *(states[index] if index < len(states) else [])]
            synced = [t for t in table_tensors if _key(t) in wanted and t.numel() and t.shape[0] == rows]
            if synced and _key(weight) in wanted:
                tables.append(_Table(offset, rows, [wanted[_key(t)] for t in synced]))
                covered.update(_key(t) for t in synced)
            offset += rows
        if tables:
            trackers.append(_TouchedRows(kernel, tables, row_counts))
    return trackers, [t for t in tensors if _key(t) not in covered]


def _optimizer_states(kernel: nn.Module) -> list[list[torch.Tensor]]:
    emb = getattr(kernel, "_emb_module", None)
    if emb is None or not hasattr(emb, "split_optimizer_states"):
        return []
    try:
        return [list(states) for states in emb.split_optimizer_states()]
    except NotImplementedError:  # OptimType.NONE
        return []


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

"""Keeping the replicas of the sharded tables in step: average over the replica group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.optim.keyed import KeyedOptimizer

from lightning_recsys.parallel.comm_accounting import comm_purpose

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


class ReplicaSynchronizer:
    """Averages this rank's embedding shards (and optionally the fused optimizer state) over its replicas.

    Tensors are averaged in place with one all-reduce per bucket of at most ``bucket_bytes``
    (tensors of one dtype flattened together), then divided by the replica count; every replica ends
    with bit-identical values. Data-parallel tables are not included: DDP already keeps them equal
    on all ranks.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        replica_group: dist.ProcessGroup,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1.")
        self._tensors = _unique_floating(tensors)
        self._group = replica_group
        self._num_replicas = dist.get_world_size(replica_group)
        self._buckets = _buckets(self._tensors, bucket_bytes)

    @classmethod
    def for_sharded_modules(
        cls,
        modules: list[nn.Module],
        fused_optimizer: KeyedOptimizer,
        replica_group: dist.ProcessGroup,
        *,
        include_optimizer_state: bool,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> ReplicaSynchronizer:
        """Synchronize the local shards of ``modules``' sharded tables and of the fused optimizer's state."""
        tensors = [t for module in modules for t in _local_shard_tensors(module.state_dict().values())]
        if include_optimizer_state:
            tensors += [t for state in fused_optimizer.state.values() for t in _local_shard_tensors(state.values())]
        return cls(tensors, replica_group, bucket_bytes=bucket_bytes)

    @property
    def num_tensors(self) -> int:
        return len(self._tensors)

    @property
    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors)

    @torch.no_grad()
    def sync(self) -> None:
        """Average every tensor over the replica group."""
        with comm_purpose("replica_sync"):
            for bucket in self._buckets:
                flat = _flatten(bucket)
                dist.all_reduce(flat, group=self._group)
                flat.div_(self._num_replicas)
                _unflatten_into(flat, bucket)

    @torch.no_grad()
    def broadcast_from_first_replica(self) -> None:
        """Make every replica a copy of the first one (used once after sharding, so replicas start equal)."""
        with comm_purpose("replica_sync"):
            for bucket in self._buckets:
                flat = _flatten(bucket)
                dist.broadcast(flat, group=self._group, group_src=0)
                _unflatten_into(flat, bucket)


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

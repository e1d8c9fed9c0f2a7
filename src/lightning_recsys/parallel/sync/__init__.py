"""Replica sync (2D): averaging the tables across sharding groups, touched rows or whole shards,
blocking or overlapped, all-reduce or all-gather, fp32, bf16 or fp8 deltas (``ReplicaSyncConfig``)."""

from lightning_recsys.parallel.sync.replica_sync import ReplicaSynchronizer, SyncStats, SyncTotals
from lightning_recsys.parallel.sync.replica_sync_config import ReplicaSyncConfig
from lightning_recsys.parallel.sync.sync_gather import change_bytes_per_row

__all__ = [
    "ReplicaSyncConfig",
    "ReplicaSynchronizer",
    "SyncStats",
    "SyncTotals",
    "change_bytes_per_row",
]

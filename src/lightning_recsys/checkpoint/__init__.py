"""Trainer-free DCP checkpoints of sharded models: atomic save, resharding load, unsharded export.

No Lightning imports: the strategy's CheckpointIO plugin, ``lightning_recsys.strategies.DCPCheckpointIO``,
and its hooks call this layer.
"""

from lightning_recsys.checkpoint.async_save import AsyncCheckpointHandle, AsyncCheckpointSaver
from lightning_recsys.checkpoint.dcp_io import (
    CheckpointError,
    LoadedCheckpoint,
    ShardedState,
    default_storage_writer,
    load_checkpoint,
    save_checkpoint,
)
from lightning_recsys.checkpoint.directory import (
    FORMAT_VERSION,
    CheckpointMeta,
    UncommittedCheckpointError,
    is_committed,
    latest_checkpoint,
    read_meta,
)
from lightning_recsys.checkpoint.safe_reading import CheckpointCorruptError, UnsafeCheckpointError
from lightning_recsys.checkpoint.safetensors_export import export_safetensors
from lightning_recsys.checkpoint.unsharded import load_unsharded, to_lightning_checkpoint
from lightning_recsys.checkpoint.table_state import NORMALIZED_STATES
from lightning_recsys.checkpoint.validation import CheckpointMismatchError
from lightning_recsys.checkpoint.write_errors import CheckpointDiskFullError

__all__ = [
    "AsyncCheckpointHandle",
    "AsyncCheckpointSaver",
    "CheckpointCorruptError",
    "CheckpointDiskFullError",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointMismatchError",
    "FORMAT_VERSION",
    "LoadedCheckpoint",
    "NORMALIZED_STATES",
    "ShardedState",
    "UncommittedCheckpointError",
    "UnsafeCheckpointError",
    "default_storage_writer",
    "export_safetensors",
    "is_committed",
    "latest_checkpoint",
    "load_checkpoint",
    "load_unsharded",
    "read_meta",
    "save_checkpoint",
    "to_lightning_checkpoint",
]


"""Trainer-free DCP checkpoints of sharded models: atomic save, resharding load, unsharded export.

No Lightning imports: the strategy's CheckpointIO plugin and hooks call this layer. The plugin
itself, ``DCPCheckpointIO``, lives in ``lightning_recsys.strategies`` and is also reachable here
(imported on first access, so importing this package never imports Lightning).
"""

from typing import Any

from lightning_recsys.checkpoint.dcp_io import (
    AsyncCheckpointHandle,
    AsyncCheckpointSaver,
    CheckpointError,
    LoadedCheckpoint,
    ShardedState,
    default_storage_writer,
    load_checkpoint,
    load_unsharded,
    save_checkpoint,
)
from lightning_recsys.checkpoint.layout import (
    FORMAT_VERSION,
    CheckpointMeta,
    UncommittedCheckpointError,
    is_committed,
    latest_checkpoint,
    read_meta,
)
from lightning_recsys.checkpoint.table_state import NORMALIZED_STATES
from lightning_recsys.checkpoint.validation import CheckpointMismatchError

__all__ = [
    "AsyncCheckpointHandle",
    "AsyncCheckpointSaver",
    "CheckpointError",
    "CheckpointMeta",
    "CheckpointMismatchError",
    "FORMAT_VERSION",
    "LoadedCheckpoint",
    "NORMALIZED_STATES",
    "ShardedState",
    "UncommittedCheckpointError",
    "default_storage_writer",
    "is_committed",
    "latest_checkpoint",
    "load_checkpoint",
    "load_unsharded",
    "read_meta",
    "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name == "DCPCheckpointIO":
        from lightning_recsys.strategies.checkpoint_io import DCPCheckpointIO

        return DCPCheckpointIO
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

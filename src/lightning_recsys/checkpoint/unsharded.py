"""Reading a checkpoint into one process with no process group: an unsharded model, or Lightning's one-dict form.

For offline evaluation, serving and export (``safetensors_export``). Both read through the same checks as
the collective ``dcp_io.load_checkpoint`` (``safe_reading``), then DCP re-cuts the shards into whole tensors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_recsys.checkpoint.dcp_io import LoadedCheckpoint, _read_shards
from lightning_recsys.checkpoint.directory import HOST_STATE_FILE, read_meta, resolve
from lightning_recsys.checkpoint.host_state_checks import ModuleTreeSnapshot, check_reshape_record
from lightning_recsys.checkpoint.safe_reading import (
    INDEX_FILE,
    check_storage,
    corrupt,
    preload_byte_items,
    read_host_state,
    read_index,
)
from lightning_recsys.checkpoint.validation import MODEL_NAMESPACE, check_entries, model_entries
from lightning_recsys.parallel.sharding import RESHAPE_CHECKPOINT_KEY, apply_recorded_reshape, find_embedding_modules

def load_unsharded(
    path: str | os.PathLike[str],
    module: nn.Module,
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    trusted: bool = False,
) -> LoadedCheckpoint:
    """Load a checkpoint's model state into an unsharded ``module`` in this process, with no process group.

    For offline evaluation and serving: the tables are read whole (any saving topology), the
    optimizer state is not read. ``module`` must have the saved model's structure, with real (not
    meta) storage. Validation and ``strict`` are as in ``load_checkpoint``. A checkpoint saved with
    ``PlanningConfig(reshape_tables=True)`` records its reshaped tables; ``module`` (built with the
    original tables) is reshaped the same way, in place, before it loads. ``trusted`` and the errors of
    a crafted or damaged checkpoint are as in ``load_checkpoint``.
    """
    directory = resolve(path)  # the newest committed copy of this name (see directory.py)
    meta = read_meta(directory)
    metadata = read_index(directory / INDEX_FILE, trusted=trusted)
    check_storage(metadata, directory)
    host_state = read_host_state(directory, weights_only)
    record = check_reshape_record((host_state or {}).get(RESHAPE_CHECKPOINT_KEY), directory / HOST_STATE_FILE)
    tree = ModuleTreeSnapshot(module)
    try:
        # Saved with reshape_tables=True: rebuild the original tables as they were reshaped for training.
        apply_recorded_reshape(module, record)
        targets = _unsharded_targets(module, metadata, directory, strict=strict, trusted=trusted)
    except BaseException:
        tree.restore()  # a refused load leaves the module tree as it was, not half reshaped
        raise
    _read_shards(targets, directory, trusted=trusted, metadata=metadata, no_dist=True)
    # In case a module's state_dict() returns copies rather than views of its storage.
    module.load_state_dict({k.removeprefix("model."): v for k, v in targets.items()}, strict=False)
    return LoadedCheckpoint(path=directory, meta=meta, host_state=host_state)


def _unsharded_targets(module: nn.Module, metadata: Metadata, directory: Path, *, strict: bool, trusted: bool) -> dict[str, Any]:
    """``module``'s tensors to load, keyed as saved, after every check against the checkpoint (nothing copied yet)."""
    model_state = module.state_dict()
    on_meta = sorted(k for k, v in model_state.items() if isinstance(v, torch.Tensor) and v.is_meta)
    if on_meta:
        raise ValueError(
            f"{type(module).__name__} has tensors on the meta device ({on_meta[:3]}...), which cannot hold loaded "
            "values; build the module for export without device='meta'."
        )
    if any(isinstance(v, ShardedTensor) for v in model_state.values()):
        raise ValueError(
            "load_unsharded() needs an unsharded module, but this one has ShardedTensors; use load_checkpoint() "
            "on every rank for a sharded model."
        )
    tables = {
        f"{fqn}.{k}" if fqn else k
        for fqn, sub in find_embedding_modules(module).items()
        for k in sub.state_dict()
    }
    expected = model_entries(model_state, tables)
    preload_byte_items(metadata, directory, keys={e.key for e in expected}, trusted=trusted)
    to_load = check_entries(expected, metadata, path=directory, strict=strict, optimizer_name=None, saved_optimizer=None)
    return {e.key: model_state[e.key.removeprefix("model.")] for e in to_load}


def to_lightning_checkpoint(
    path: str | os.PathLike[str], *, weights_only: bool | None = None, trusted: bool = False
) -> dict[str, Any]:
    """The checkpoint ``path`` in Lightning's one-dict form, read in this process with no process group.

    Its host state (epoch, global step, loops, callbacks, dense optimizers, hyperparameters, ...)
    plus ``"state_dict"``: the model state with every table whole, as the unsharded module's
    ``state_dict()`` names it. ``torch.save`` it to a file and any ``LightningModule.load_from_checkpoint``
    (which cannot open a DCP directory) reads it; the embedding optimizer state is left out. Needs
    memory for the whole model. ``trusted`` and the errors of a crafted or damaged checkpoint are as
    in ``load_checkpoint``.
    """
    directory = resolve(path)  # the newest committed copy of this name (see directory.py)
    read_meta(directory)  # refuses uncommitted, damaged and foreign directories
    metadata = read_index(directory / INDEX_FILE, trusted=trusted)
    check_storage(metadata, directory)
    host_state = read_host_state(directory, weights_only) or {}
    prefix = MODEL_NAMESPACE + "."
    targets: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        # DCP saves a nested value (a module's extra state dict) flattened; its index keeps the path.
        path = (metadata.planner_data or {}).get(key, (key,))
        if not str(path[0]).startswith(prefix):
            continue
        node = targets
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # a crafted planner_data path through a tensor's key
                raise corrupt(directory / INDEX_FILE, f"the index field Metadata.planner_data[{key!r}] runs through another entry")
        if path[-1] in node:
            raise corrupt(directory / INDEX_FILE, f"the index field Metadata.planner_data[{key!r}] names an entry twice")
        # Whole tensors of the saved global shapes; DCP replaces a non-tensor value as it reads it.
        # check_storage proved the chunks tile each tensor and fit in the shards: the size is bounded by the
        # files, and every element is overwritten; zeros all the same, so nothing of this process can leak.
        node[path[-1]] = torch.zeros(tuple(item.size), dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
    preload_byte_items(metadata, directory, keys=set(targets), trusted=trusted)
    _read_shards(targets, directory, trusted=trusted, metadata=metadata, no_dist=True)
    return {**host_state, "state_dict": {k.removeprefix(prefix): v for k, v in targets.items()}}


__all__ = ["load_unsharded", "to_lightning_checkpoint"]

"""Reading a DCP checkpoint without running code from it, and refusing a damaged or crafted one before anything is loaded.

torch 2.13's DCP trusts its files; every place where it reads one is replaced here:

- the index: ``FileSystemReader.read_metadata`` (torch/distributed/checkpoint/filesystem.py) calls a bare
  ``pickle.load`` on ``.metadata``; ``read_index`` (``index_reader``) scans it, unpickles it with an
  allow-list and checks every field (``index_checks``);
- tensor records: ``FileSystemReader.read_data`` calls ``torch.load`` on whatever byte range the index
  names, following symlinks and inflating compressed members; ``SafeFileSystemReader.read_data`` reads
  each record through ``records.read_tensor_record`` (regular files, stored members, the chunk's dtype
  and shape), the same parser ``check_storage`` ran over every record before the load began;
- byte items (non-tensor values, e.g. a module's extra state): ``DefaultLoadPlanner.load_bytes``
  (torch/distributed/checkpoint/default_planner.py) calls ``torch.load(weights_only=False)``;
  ``SafeLoadPlanner`` loads them with ``weights_only=True`` after the zip checks and the pickle scan;
- ``host_state.pt`` and its table-reshape record (``read_host_state``, ``host_state_checks``).

``trusted=True`` restores DCP's own unrestricted unpickling of the index and byte items, for a
checkpoint trusted as code; the damage checks still run.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_recsys.checkpoint.directory import HOST_STATE_FILE
from lightning_recsys.checkpoint.host_state_checks import RESHAPE_CHECKPOINT_KEY, check_reshape_record
from lightning_recsys.checkpoint.host_state_checks import RESHAPE_CHECKPOINT_KEY, check_reshape_record
from lightning_recsys.checkpoint.index_reader import (
    _TRUSTED_HOW,
    INDEX_FILE,
    INDEX_GLOBALS,
    IndexUnpickler,
    read_index,
    require_trusted_bool,
)
from lightning_recsys.checkpoint.pickle_guard import PickleRefused, scan
from lightning_recsys.checkpoint.records import BYTE_ITEM_PICKLE, check_byte_record, members, read_tensor_record
from lightning_recsys.checkpoint.safe_files import (
    CheckpointCorruptError,
    UnsafeCheckpointError,
    corrupt,
    data_root,
    open_regular,
    read_at,
    read_whole,
)
from lightning_recsys.checkpoint.storage_checks import check_flattened_keys, check_storage

MAX_HOST_STATE_BYTES = 1 << 36


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` reading only what ``check_storage`` checked, the way it checked it.

    ``metadata``: the index the caller already read and checked; DCP then gets that very object instead
    of a second read of a file that may have changed since. ``copied`` counts the tensors copied into
    the model, so that a failure can say whether the model changed.
    """

    def __init__(self, path: str | os.PathLike[str], *, trusted: bool = False, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        require_trusted_bool(trusted)
        self.trusted = trusted
        self.metadata = metadata
        self.copied = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Upstream: FileSystemReader.read_metadata (torch/distributed/checkpoint/filesystem.py) is a bare pickle.load.
        if kwargs.get("rank") is not None:
            # DCP's load falls back to a rank's own index (__<rank>.metadata) when .metadata fails; ours write none.
            raise ValueError("SafeFileSystemReader reads one index per checkpoint (.metadata), not one per rank.")
        metadata = self.metadata if self.metadata is not None else read_index(Path(self.path) / INDEX_FILE, trusted=self.trusted)
        metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as upstream does
        self.metadata = metadata
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Upstream: FileSystemReader.read_data torch.load()s each range it is given. Same loop, through our parser.
        assert self.metadata is not None, "read_metadata comes first"
        root = data_root(self.path)
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            fd = open_regular(root, name, what="the shard file", missing="the shard file the index names is missing")
            try:
                for item in items:
                    self._read_item(fd, root / name, item, planner)
            finally:
                os.close(fd)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(self, fd: int, path: Path, item: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        key = item.storage_index.fqn
        blob = read_at(fd, info.offset, info.length, path=path, what=key)
        if item.type == LoadItemType.BYTE_IO:
            check_byte_record(blob, where=str(path), what=f"the item {key!r}")
            planner.load_bytes(item, io.BytesIO(blob))
            return
        entry = self.metadata.state_dict_metadata[key]
        chunk = next((c for c in entry.chunks if MetadataIndex(key, tuple(c.offsets)) == item.storage_index), None)
        if not isinstance(entry, TensorStorageMetadata) or chunk is None:
            raise corrupt(path, f"DCP asked for a chunk of {key!r} that the index does not list")
        tensor = read_tensor_record(blob, where=str(path), what=f"the record of {key!r}", dtype=entry.properties.dtype, sizes=tuple(chunk.sizes))
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise corrupt(path, f"the record of {key!r} gives {list(tensor.size())} values where the model holds {list(target.size())}")
        target.copy_(tensor)
        self.copied += 1
        planner.commit_tensor(item, target)


def load_byte_item(data: IO[bytes], *, name: str, where: str, trusted: bool = False) -> Any:
    """``torch.load`` one DCP byte item with ``weights_only=True`` (unless ``trusted``).

    Classes allowed with ``torch.serialization.add_safe_globals`` are honoured. A refused global raises
    ``UnsafeCheckpointError`` naming the item; unreadable bytes raise ``CheckpointCorruptError``.
    """
    try:
        return torch.load(data, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as error:
        reason = _weights_only_reason(str(error))
        if not any(word in reason for word in _REFUSAL_WORDS):
            raise corrupt(where, f"the item {name!r} cannot be unpickled ({reason or error})") from error
        raise UnsafeCheckpointError(
            f"{where}: refused to load the item {name!r} (a non-tensor value, e.g. a module's extra state): "
            f"{reason} Loading it could run code chosen by whoever wrote the file; nothing was loaded. Allow a class "
            f"it needs with torch.serialization.add_safe_globals([...]), or: {_TRUSTED_HOW}"
        ) from error
    except Exception as error:  # noqa: BLE001 - whatever reading cut or overwritten bytes raises
        raise corrupt(where, f"the item {name!r} cannot be read ({type(error).__name__}: {str(error)[:300]})") from error


# torch's weights-only unpickler words its refusals (torch/_weights_only_unpickler.py) with these; an
# unknown opcode or a cut pickle ("Unsupported operand", "truncated") is damage instead.
_REFUSAL_WORDS = ("GLOBAL", "global", "reduce", "allowlisted", "Unsupported class")


def _weights_only_reason(message: str) -> str:
    """The unpickler's own line(s) from torch's "Weights only load failed" message, without its advice."""
    if "WeightsUnpickler error:" in message:
        return " ".join(message.split("WeightsUnpickler error:", 1)[1].split("\n\n")[0].split())
    parts = [p.strip() for p in message.split("\n\n") if p.strip()]
    body = [p for p in parts if not p.startswith(("Weights only load failed", "Check the documentation", "Please file an issue"))]
    return " ".join(body).replace("WeightsUnpickler error:", "").strip()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner`` with byte items loaded by ``load_byte_item`` (``weights_only=True`` unless ``trusted``)."""

    def __init__(self, *, trusted: bool = False) -> None:
        super().__init__()
        require_trusted_bool(trusted)
        self.trusted = trusted

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Upstream: DefaultLoadPlanner.load_bytes (torch/distributed/checkpoint/default_planner.py) uses weights_only=False.
        fqn = read_item.dest_index.fqn
        loaded = load_byte_item(value, name=fqn, where="a .distcp shard", trusted=self.trusted)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def preload_byte_items(metadata: Metadata, directory: Path, *, keys: set[str] | None, trusted: bool = False) -> None:
    """Load the byte items under ``keys`` (state-dict keys, a nested value's items included; all if None).

    So that a refused or unreadable item fails before DCP copies any tensor into the model (DCP
    reads items file by file, in no order that puts them first). Call ``check_storage`` first.
    """
    root = data_root(directory)
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata) or not (keys is None or _under(key, keys, metadata.planner_data)):
            continue
        info = metadata.storage_data[MetadataIndex(key)]
        fd = open_regular(root, info.relative_path, what="the shard file", missing="the shard file the index names is missing")
        try:
            blob = read_at(fd, info.offset, info.length, path=root / info.relative_path, what=key)
        finally:
            os.close(fd)
        load_byte_item(io.BytesIO(blob), name=key, where=str(root / info.relative_path), trusted=trusted)


def read_host_state(directory: Path, weights_only: bool | None) -> dict[str, Any] | None:
    """``host_state.pt`` (None if absent): a regular file, stored zip members, its pickle scanned, then ``torch.load``.

    torch's own ``weights_only`` refusal passes through as it is (the file is fine; its message says which
    globals to allow); any other problem raises ``CheckpointCorruptError`` naming the file.
    """
    root = data_root(directory)
    host_path = root / HOST_STATE_FILE
    if not os.path.lexists(host_path):
        return None
    data = read_whole(root, HOST_STATE_FILE, what="the host state file", limit=MAX_HOST_STATE_BYTES)
    parts = members(data, where=str(host_path), what="the file")
    try:
        scan(parts["data.pkl"], BYTE_ITEM_PICKLE)
    except PickleRefused as error:
        raise corrupt(host_path, f"the file cannot be read ({error})") from error
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except Exception as error:  # noqa: BLE001
        if "Weights only load failed" in str(error):
            raise  # the file is fine; torch's message says which globals to allow
        raise corrupt(host_path, f"the file cannot be read ({type(error).__name__}: {str(error)[:300]})") from error
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise corrupt(host_path, f"the file holds a {type(state).__name__}, not the trainer state's dict of named entries")
    check_reshape_record(state.get(RESHAPE_CHECKPOINT_KEY), host_path)  # every reader, before anyone reshapes by it
    return state


def _under(key: str, roots: set[str], planner_data: Any) -> bool:
    """Whether the flat index key ``key`` is one of ``roots`` or an item of a nested value saved under one."""
    path = (planner_data or {}).get(key, (key,)) if isinstance(planner_data, dict) else (key,)
    return key in roots or (bool(path) and str(path[0]) in roots)


__all__ = [
    "INDEX_FILE",
    "INDEX_GLOBALS",
    "CheckpointCorruptError",
    "IndexUnpickler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "check_flattened_keys",
    "check_storage",
    "corrupt",
    "load_byte_item",
    "preload_byte_items",
    "read_host_state",
    "read_index",
    "require_trusted_bool",
]

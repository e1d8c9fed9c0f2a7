"""Every field of an unpickled DCP index, checked for type and range before any loader reads it.

An index that unpickles can still hold a string where DCP writes a ``torch.Size``, a negative
offset, a chunk of the wrong rank or a storage descriptor we do not read; each would surface later as
a raw ``TypeError``/``AttributeError``/``IndexError`` deep in DCP, or worse, as a silently wrong load.
``check_index`` raises ``CheckpointCorruptError`` naming the file and the field instead. The
geometry (chunks tiling their tensor, byte ranges inside the shards) is ``storage_checks``' part.
"""

from __future__ import annotations

import pathlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from lightning_recsys.checkpoint.safe_files import check_plain_name, corrupt

MAX_DIMS = 16  # no model tensor of ours has more; bounds the per-chunk work
MAX_ELEMENTS = 1 << 48
# dtypes a model's state can hold and a record can carry (see records.STORAGE_DTYPES).
_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
}


def _field(obj: Any, name: str, where: Path, label: str) -> Any:
    try:
        return object.__getattribute__(obj, name)  # never a crafted __getattr__; DCP's classes have none
    except AttributeError:
        raise corrupt(where, f"the index field {label}.{name} is missing") from None


def _is_int(value: Any) -> bool:
    return type(value) is int


def check_size(value: Any, *, where: Path, label: str, dims: int | None = None) -> tuple[int, ...]:
    """A ``torch.Size`` (or tuple) of non-negative ints, of ``dims`` dimensions if given."""
    if not isinstance(value, (torch.Size, tuple)) or len(value) > MAX_DIMS or not all(_is_int(v) and 0 <= v < MAX_ELEMENTS for v in value):
        raise corrupt(where, f"the index field {label} is {str(value)[:80]!r}, not a shape of non-negative integers")
    if dims is not None and len(value) != dims:
        raise corrupt(where, f"the index field {label} has {len(value)} dimensions, its tensor {dims}")
    return tuple(value)


def check_index(metadata: Any, where: Path, *, trusted: bool = False) -> None:
    """Raise ``CheckpointCorruptError`` naming ``where`` and the field unless ``metadata`` is a well-formed DCP index."""
    if type(metadata) is not Metadata:
        raise corrupt(where, f"the index is a {type(metadata).__name__}, not DCP's Metadata")
    entries = _field(metadata, "state_dict_metadata", where, "Metadata")
    storage = _field(metadata, "storage_data", where, "Metadata")
    if type(entries) is not dict or type(storage) is not dict:
        raise corrupt(where, "the index lacks its state_dict_metadata or storage_data mapping")
    for key, item in entries.items():
        if type(key) is not str or type(item) not in (TensorStorageMetadata, BytesStorageMetadata):
            raise corrupt(where, f"the index entry {str(key)[:80]!r} is a {type(item).__name__}, not a tensor or bytes entry")
        if type(item) is TensorStorageMetadata:
            _check_tensor_entry(key, item, where)
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            raise corrupt(where, f"the index's storage entry {str(index)[:80]!r} is not DCP's file storage info")
        _check_storage_entry(index, info, where)
    _check_planner_data(_field(metadata, "planner_data", where, "Metadata"), entries, where)
    version = _field(metadata, "version", where, "Metadata")
    if version is not None and type(version) is not str:
        raise corrupt(where, f"the index field Metadata.version is a {type(version).__name__}, not a string")
    _check_storage_meta(_field(metadata, "storage_meta", where, "Metadata"), where, trusted=trusted)


def _check_tensor_entry(key: str, item: TensorStorageMetadata, where: Path) -> None:
    label = f"state_dict_metadata[{key!r}]"
    size = check_size(_field(item, "size", where, label), where=where, label=f"{label}.size")
    properties = _field(item, "properties", where, label)
    if type(properties) is not TensorProperties:
        raise corrupt(where, f"the index field {label}.properties is a {type(properties).__name__}")
    dtype = _field(properties, "dtype", where, f"{label}.properties")
    if dtype not in _DTYPES:
        raise corrupt(where, f"the index field {label}.properties.dtype is {str(dtype)[:40]}, not a dtype a checkpoint of ours holds")
    if _field(properties, "layout", where, f"{label}.properties") != torch.strided:
        raise corrupt(where, f"the index field {label}.properties.layout is not torch.strided")
    chunks = _field(item, "chunks", where, label)
    if type(chunks) is not list:
        raise corrupt(where, f"the index field {label}.chunks is a {type(chunks).__name__}, not a list")
    for i, chunk in enumerate(chunks):
        if type(chunk) is not ChunkStorageMetadata:
            raise corrupt(where, f"the index field {label}.chunks[{i}] is a {type(chunk).__name__}")
        for name in ("offsets", "sizes"):
            check_size(_field(chunk, name, where, f"{label}.chunks[{i}]"), where=where, label=f"{label}.chunks[{i}].{name}", dims=len(size))


def _check_storage_entry(index: MetadataIndex, info: _StorageInfo, where: Path) -> None:
    fqn = _field(index, "fqn", where, "MetadataIndex")
    if type(fqn) is not str:
        raise corrupt(where, f"the index has a storage key whose fqn is a {type(fqn).__name__}")
    label = f"storage_data[{fqn!r}]"
    offset = _field(index, "offset", where, label)
    if offset is not None:
        check_size(offset, where=where, label=f"{label} key offset")
    hint = _field(index, "index", where, label)
    if hint is not None and not _is_int(hint):
        raise corrupt(where, f"the index field {label} key index is {hint!r}")
    check_plain_name(_field(info, "relative_path", where, label), where=where, field=f"the index's {label}.relative_path")
    for name in ("offset", "length"):
        value = _field(info, name, where, label)
        if not _is_int(value) or value < 0 or value >= 1 << 62:
            raise corrupt(where, f"the index field {label}.{name} is {value!r}, not a non-negative integer")
    descriptors = _field(info, "transform_descriptors", where, label)
    if descriptors:  # a compressed or otherwise transformed record: this reader reads plain records only
        raise corrupt(where, f"the index field {label}.transform_descriptors is {str(descriptors)[:80]!r}; this reader reads untransformed records only")


def _check_planner_data(planner_data: Any, entries: dict[str, Any], where: Path) -> None:
    """DCP's flattening: each entry's key is its path joined with dots (``_nested_dict.flatten_state_dict``)."""
    if planner_data is None:
        return
    if type(planner_data) is not dict:
        raise corrupt(where, f"the index field Metadata.planner_data is a {type(planner_data).__name__}, not a dict")
    for key, path in planner_data.items():
        ok = type(key) is str and type(path) in (tuple, list) and 0 < len(path) <= 64
        if not ok or not all(type(p) in (str, int) for p in path):
            raise corrupt(where, f"the index field Metadata.planner_data[{str(key)[:80]!r}] is not a path of names")
        if key not in entries or key != ".".join(map(str, path)):
            raise corrupt(where, f"the index field Metadata.planner_data[{key[:80]!r}] gives the path {list(path)[:8]}, which is not that entry's")


def _check_storage_meta(meta: Any, where: Path, *, trusted: bool) -> None:
    if meta is None:
        return
    if type(meta) is not StorageMeta:
        raise corrupt(where, f"the index field Metadata.storage_meta is a {type(meta).__name__}")
    if trusted:
        return  # the loader only sets its load_id
    checkpoint_id = _field(meta, "checkpoint_id", where, "storage_meta")
    if checkpoint_id is not None and type(checkpoint_id) not in (str, pathlib.PosixPath):
        raise corrupt(where, f"the index field storage_meta.checkpoint_id is a {type(checkpoint_id).__name__}")
    for name in ("save_id", "load_id"):
        value = _field(meta, name, where, "storage_meta")
        if value is not None and type(value) is not str:
            raise corrupt(where, f"the index field storage_meta.{name} is a {type(value).__name__}")
    modules = _field(meta, "modules", where, "storage_meta")
    if type(modules) is not list or not all(type(m) is str for m in modules):
        raise corrupt(where, "the index field storage_meta.modules is not a list of strings")

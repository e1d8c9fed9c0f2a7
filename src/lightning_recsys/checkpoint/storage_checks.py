"""Holding a checked index against the shard files, record by record, before anything is copied into a model.

``check_storage`` is the plan-before-you-touch step of every load path:

- every tensor's chunks tile it exactly (inside its shape, no overlap, no gap), so that no element of
  the model or of an export is left unwritten (``torch.empty`` garbage) or written twice;
- every storage entry names a regular file of the data directory (``safe_files``) and a byte range
  inside it, framed as a ``torch.save`` record, at least as long as its chunk's bytes;
- every tensor record is read and parsed (``records.read_tensor_record``): stored members only, a plain
  tensor of the chunk's dtype and shape; every byte item passes the zip checks and the pickle scan.

So all records are valid before the first copy, and the sizes a loader allocates from the index are
bounded by the bytes the shards hold. Raises ``CheckpointCorruptError`` (or ``UnsafeCheckpointError``)
naming the file and the field.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from lightning_recsys.checkpoint.records import check_byte_record, read_tensor_record
from lightning_recsys.checkpoint.safe_files import corrupt, data_root, file_size, open_regular, read_at

INDEX_FILE = ".metadata"
_ZIP_START = b"PK\x03\x04"  # torch.save's zip: a local file header first ...
_ZIP_END = b"PK\x05\x06"  # ... the end-of-central-directory record last
_ZIP_END_SIZE = 22
_MAX_PAIR_CHECKS = 20_000_000  # overlap tests per tensor; a real index needs a few per chunk


def numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def check_tiling(key: str, item: TensorStorageMetadata, index_path: Path) -> None:
    """The chunks of ``key`` lie inside its shape, do not overlap, and cover it: their volumes add up to its own."""
    size = tuple(item.size)
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in item.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if any(o + n > s for o, n, s in zip(offsets, sizes, size)):
            raise corrupt(index_path, f"the index places a chunk of {key!r} at offsets {list(offsets)}, sizes {list(sizes)}, outside its shape {list(size)}")
        if numel(sizes):
            boxes.append((offsets, sizes))
    covered = sum(numel(s) for _, s in boxes)
    if covered > numel(size) or _overlap(boxes):
        raise corrupt(index_path, f"the index gives {key!r} chunks that overlap; each element of a tensor is saved once")
    if covered < numel(size):
        raise corrupt(index_path, f"the index's chunks of {key!r} cover {covered} of its {numel(size)} elements: part of the tensor has no saved values")


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two boxes intersect: a sweep along the first dimension, testing only boxes whose spans meet there."""
    if not boxes or not boxes[0][0]:
        return len(boxes) > 1  # scalars: one chunk each
    order = sorted(boxes, key=lambda b: b[0][0])
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    checks = 0
    for offsets, sizes in order:
        active = [b for b in active if b[0][0] + b[1][0] > offsets[0]]
        for other in active:
            checks += 1
            if checks > _MAX_PAIR_CHECKS:
                return True  # too many chunks sharing rows to check: no index of ours looks like this
            if all(o1 < o2 + n2 and o2 < o1 + n1 for o1, n1, o2, n2 in zip(offsets, sizes, other[0], other[1])):
                return True
        active.append((offsets, sizes))
    return False


class _Shards:
    """The shard files the index names, each opened once (no symlink, regular file) and closed with the check."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fds: dict[str, int] = {}
        self.sizes: dict[str, int] = {}

    def fd(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = open_regular(self.root, name, what="the shard file", missing="the shard file the index names is missing")
            self.sizes[name] = file_size(self.fds[name])
        return self.fds[name]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def check_range(shards: _Shards, info: _StorageInfo, key: str, *, need: int = 0) -> Path:
    """The record's byte range lies inside its file and is framed as a ``torch.save`` record."""
    path = shards.root / info.relative_path
    fd = shards.fd(info.relative_path)
    offset, length, size = info.offset, info.length, shards.sizes[info.relative_path]
    if length < _ZIP_END_SIZE + len(_ZIP_START):
        raise corrupt(shards.root / INDEX_FILE, f"the index gives {key!r} the byte range offset={offset}, length={length}")
    if offset + length > size:
        raise corrupt(path, f"the shard file is truncated: the index places {key!r} at bytes {offset}..{offset + length}, but the file has {size} bytes")
    start = read_at(fd, offset, len(_ZIP_START), path=path, what=key)
    end = read_at(fd, offset + length - _ZIP_END_SIZE, len(_ZIP_END), path=path, what=key)
    if start != _ZIP_START or end != _ZIP_END:
        raise corrupt(path, f"the bytes of {key!r} at {offset}..{offset + length} are not a torch.save record (overwritten, or the index's offsets are wrong)")
    if length < need:
        raise corrupt(path, f"the index gives the chunk of {key!r} {length} bytes, fewer than the {need} its shape needs: the index disagrees with the shard")
    return path


def check_storage(metadata: Metadata, directory: Path) -> None:
    """Hold the (checked) index against the shard files and every record in them; see the module docstring."""
    root = data_root(directory)
    index_path = root / INDEX_FILE
    storage: dict[MetadataIndex, _StorageInfo] = metadata.storage_data
    shards = _Shards(root)
    try:
        tensors: dict[str, list[tuple[Any, _StorageInfo]]] = defaultdict(list)
        for key, item in metadata.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                info = storage.get(MetadataIndex(key))
                if info is None:
                    raise corrupt(index_path, f"the index lists the item {key!r} but no file holds it")
                path = check_range(shards, info, key)
                blob = read_at(shards.fd(info.relative_path), info.offset, info.length, path=path, what=key)
                check_byte_record(blob, where=str(path), what=f"the item {key!r}")
                continue
            check_tiling(key, item, index_path)
            for chunk in item.chunks:
                info = storage.get(MetadataIndex(key, tuple(chunk.offsets)))
                if info is None:
                    raise corrupt(index_path, f"the index lists a chunk of {key!r} at offsets {list(chunk.offsets)} but no file holds it")
                need = numel(tuple(chunk.sizes)) * item.properties.dtype.itemsize
                tensors[key].append((chunk, check_range(shards, info, key, need=need)))
        for key, chunks in tensors.items():
            item = metadata.state_dict_metadata[key]
            for chunk, path in chunks:
                info = storage[MetadataIndex(key, tuple(chunk.offsets))]
                blob = read_at(shards.fd(info.relative_path), info.offset, info.length, path=path, what=key)
                read_tensor_record(
                    blob, where=str(path), what=f"the record of {key!r} at offsets {list(chunk.offsets)}",
                    dtype=item.properties.dtype, sizes=tuple(chunk.sizes),
                )
    finally:
        shards.close()


def check_flattened_keys(targets: dict[str, Any], metadata: Metadata, directory: Path) -> None:
    """Every key DCP will look up for ``targets`` (a nested value's items flattened, as its planner does) is in the index.

    Otherwise DCP's planner stops with a bare ``RuntimeError`` (a nested item renamed in the index); the
    model is not touched either way, but this names the item.
    """
    flat, _ = flatten_state_dict(targets)
    missing = sorted(k for k in flat if k not in metadata.state_dict_metadata)
    if missing:
        raise corrupt(data_root(directory) / INDEX_FILE, f"the index lacks {missing[:5]}, which the state to load holds (renamed or dropped entries)")

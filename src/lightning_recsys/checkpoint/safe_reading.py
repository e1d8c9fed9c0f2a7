"""Reading a DCP checkpoint without running code from it, and naming a damaged file before anything is loaded.

torch 2.13's DCP trusts its files in two places, both replaced here:

- the index: ``FileSystemReader.read_metadata`` (torch/distributed/checkpoint/filesystem.py) calls a bare
  ``pickle.load`` on ``.metadata``; ``SafeFileSystemReader`` unpickles it with ``IndexUnpickler``, which
  allows only the classes ``INDEX_GLOBALS`` lists;
- byte items (non-tensor values, e.g. a module's extra state): ``DefaultLoadPlanner.load_bytes``
  (torch/distributed/checkpoint/default_planner.py) calls ``torch.load(weights_only=False)``;
  ``SafeLoadPlanner`` loads them with ``weights_only=True``.

Tensors are already read with ``weights_only=True`` by DCP (``FileSystemReader.read_data``).
``check_storage`` compares the index with the shard files (names, sizes, record framing) and
``preload_byte_items`` loads the byte items first, so a damaged or crafted checkpoint is refused before one
tensor is copied into the model.
``trusted=True`` restores DCP's own unrestricted reading, for a checkpoint trusted as code.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem

from lightning_recsys.checkpoint.directory import HOST_STATE_FILE, UncommittedCheckpointError

INDEX_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# What torch 2.13's DCP pickles into ``.metadata``, found by recording ``find_class`` while unpickling the
# index of every kind of checkpoint this package writes (tests/unit/test_checkpoint_security.py holds it to that).
INDEX_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format, an Enum
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout: a lookup by name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id, the directory it was saved to
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)

_TRUSTED_HOW = (
    "If you trust this checkpoint as you would trust code, load it with trusted=True: load_checkpoint(), "
    "load_unsharded(), to_lightning_checkpoint() and export_safetensors() take it, as does "
    "load_from_checkpoint(..., trusted=True); under a Trainer, TwoDRecStrategy(checkpoint_io=DCPCheckpointIO(trusted=True))."
)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds a pickled global that loading it would import or call; nothing was loaded."""


class CheckpointCorruptError(UncommittedCheckpointError):
    """A checkpoint file is missing, cut short or disagrees with the index; it was refused before anything was loaded."""


def corrupt(path: Path | str, problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{path}: {problem}; the checkpoint is damaged (a truncated, overwritten or deleted file) and nothing was "
        "loaded. Load another checkpoint, e.g. an earlier one of the same run."
    )


def _is_allowed_index_global(module: str, name: str) -> bool:
    if (module, name) in INDEX_GLOBALS:
        return True
    # A dtype pickles as a global of the torch module (torch.float32, torch.bfloat16, ...).
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index; any global outside ``INDEX_GLOBALS`` and torch's dtypes raises ``UnsafeCheckpointError``."""

    def __init__(self, file: IO[bytes], *, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if _is_allowed_index_global(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.path}: refused to unpickle the global {module}.{name}: a DCP index holds only DCP's metadata "
            f"classes, torch.Size, dtypes and plain values, and loading this one could run code chosen by whoever "
            f"wrote the file. Nothing was loaded. {_TRUSTED_HOW}"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.path}: refused a persistent id in the index (DCP writes none). {_TRUSTED_HOW}")


def require_trusted_bool(trusted: object) -> None:
    """``trusted`` must be a real bool: a truthy string such as "false" must not switch the protection off."""
    if not isinstance(trusted, bool):
        raise ValueError(f"trusted={trusted!r} must be a bool (True only for a checkpoint you trust as you would trust code).")


def read_index(path: Path, *, trusted: bool = False) -> Metadata:
    """Unpickle the DCP index file ``path``: restricted unless ``trusted``; damage raises ``CheckpointCorruptError``."""
    require_trusted_bool(trusted)
    try:
        with open(path, "rb") as f:
            metadata = pickle.load(f) if trusted else IndexUnpickler(f, path=path).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError as error:
        raise corrupt(path, "the index file is missing") from error
    except Exception as error:  # noqa: BLE001 - whatever unpickling cut or overwritten bytes raises
        problem = "the index file is empty" if path.is_file() and path.stat().st_size == 0 else "the index cannot be read"
        raise corrupt(path, f"{problem} ({type(error).__name__}: {error})") from error
    _check_index_types(metadata, path)
    return metadata


def _check_index_types(metadata: Any, path: Path) -> None:
    if not isinstance(metadata, Metadata):
        raise corrupt(path, f"the index is a {type(metadata).__name__}, not DCP's Metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise corrupt(path, "the index lacks its state_dict_metadata or storage_data mapping")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(item, (TensorStorageMetadata, BytesStorageMetadata)):
            raise corrupt(path, f"the index entry {key!r} is a {type(item).__name__}, not a tensor or bytes entry")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise corrupt(path, f"the index's storage entry {index!r} is not DCP's file storage info")


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with the index unpickled by ``IndexUnpickler`` (unless ``trusted``)."""

    def __init__(self, path: str | os.PathLike[str], *, trusted: bool = False) -> None:
        super().__init__(path)
        require_trusted_bool(trusted)
        self.trusted = trusted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Upstream: FileSystemReader.read_metadata (torch/distributed/checkpoint/filesystem.py) is a bare pickle.load.
        if kwargs.get("rank") is not None:
            # DCP's load falls back to a rank's own index (__<rank>.metadata) when .metadata fails; ours write none.
            raise ValueError("SafeFileSystemReader reads one index per checkpoint (.metadata), not one per rank.")
        metadata = read_index(Path(self.path) / INDEX_FILE, trusted=self.trusted)
        metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as upstream does
        return metadata


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
        raise corrupt(where, f"the item {name!r} cannot be read ({type(error).__name__}: {error})") from error


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


def read_host_state(directory: Path, weights_only: bool | None) -> dict[str, Any] | None:
    """``host_state.pt`` (None if absent), with ``torch.load(weights_only=...)``: torch's own refusal passes through."""
    host_path = directory / HOST_STATE_FILE
    if not host_path.is_file():
        return None
    try:
        return torch.load(host_path, map_location="cpu", weights_only=weights_only)
    except Exception as error:  # noqa: BLE001
        if "Weights only load failed" in str(error):
            raise  # the file is fine; torch's message says which globals to allow
        raise corrupt(host_path, f"the file cannot be read ({type(error).__name__}: {error})") from error


# torch.save writes a zip archive: a local file header first, the end-of-central-directory record last.
_ZIP_START = b"PK\x03\x04"
_ZIP_END = b"PK\x05\x06"
_ZIP_END_SIZE = 22


def check_storage(metadata: Metadata, directory: Path) -> None:
    """Hold the index against the shard files before anything is read into a model.

    Every storage entry must name a file in ``directory`` that exists and holds its byte range, which
    must be a whole ``torch.save`` record, large enough for its chunk; every chunk of a tensor must lie
    inside the tensor and have a storage entry. Raises ``CheckpointCorruptError`` naming the file.
    """
    index_path = directory / INDEX_FILE
    storage = metadata.storage_data
    sizes: dict[str, int] = {}
    for info in storage.values():
        if info.relative_path not in sizes:
            sizes[info.relative_path] = _shard_size(directory, info.relative_path, index_path)
    records: dict[str, list[tuple[int, int, str]]] = {}  # file -> (offset, length, key) of each record to frame-check
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            info = storage.get(MetadataIndex(key))
            if info is None:
                raise corrupt(index_path, f"the index lists the item {key!r} but no file holds it")
            _check_range(info, key, directory, sizes, records)
            continue
        for chunk in item.chunks:
            _check_chunk(key, item, chunk, storage, directory, index_path, sizes, records)
    for name, ranges in records.items():
        _check_framing(directory / name, sorted(ranges))


def preload_byte_items(metadata: Metadata, directory: Path, *, keys: set[str] | None, trusted: bool = False) -> None:
    """Load the byte items under ``keys`` (state-dict keys, a nested value's items included; all if None).

    So that a refused or unreadable item fails before DCP copies any tensor into the model (DCP
    reads items file by file, in no order that puts them first). Call ``check_storage`` first.
    """
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata) or not (keys is None or _under(key, keys, metadata.planner_data)):
            continue
        info = metadata.storage_data[MetadataIndex(key)]
        if getattr(info, "transform_descriptors", None):
            continue  # a transformed record: SafeLoadPlanner still loads it with weights_only=True
        path = directory / info.relative_path
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = io.BytesIO(f.read(info.length))
        load_byte_item(data, name=key, where=str(path), trusted=trusted)


def _shard_size(directory: Path, name: Any, index_path: Path) -> int:
    if not isinstance(name, str) or not name or name != os.path.basename(name) or name in (".", ".."):
        raise corrupt(index_path, f"the index names the shard file {name!r}, which is not a file name inside the checkpoint")
    path = directory / name
    if not path.is_file():
        raise corrupt(path, "the shard file the index names is missing")
    return path.stat().st_size


def _check_range(
    info: _StorageInfo, key: str, directory: Path, sizes: dict[str, int], records: dict[str, list[tuple[int, int, str]]]
) -> Path:
    path = directory / info.relative_path
    offset, length = info.offset, info.length
    if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= _ZIP_END_SIZE):
        raise corrupt(directory / INDEX_FILE, f"the index gives {key!r} the byte range offset={offset!r}, length={length!r}")
    if offset + length > sizes[info.relative_path]:
        raise corrupt(
            path,
            f"the shard file is truncated: the index places {key!r} at bytes {offset}..{offset + length}, but the "
            f"file has {sizes[info.relative_path]} bytes",
        )
    if not getattr(info, "transform_descriptors", None):  # a transformed (e.g. compressed) record has no zip framing
        records.setdefault(info.relative_path, []).append((offset, length, key))
    return path


def _check_framing(path: Path, ranges: list[tuple[int, int, str]]) -> None:
    """Each record starts with a zip local header and ends with the end-of-central-directory record (one open per file)."""
    with open(path, "rb") as f:
        for offset, length, key in ranges:
            f.seek(offset)
            start = f.read(len(_ZIP_START))
            f.seek(offset + length - _ZIP_END_SIZE)
            end = f.read(len(_ZIP_END))
            if start != _ZIP_START or end != _ZIP_END:
                raise corrupt(
                    path,
                    f"the bytes of {key!r} at {offset}..{offset + length} are not a torch.save record (overwritten, "
                    "or the index's offsets are wrong)",
                )


def _check_chunk(
    key: str,
    item: TensorStorageMetadata,
    chunk: Any,
    storage: dict[MetadataIndex, _StorageInfo],
    directory: Path,
    index_path: Path,
    sizes: dict[str, int],
    records: dict[str, list[tuple[int, int, str]]],
) -> None:
    offsets, chunk_sizes, size = tuple(chunk.offsets), tuple(chunk.sizes), tuple(item.size)
    if len(offsets) != len(size) or len(chunk_sizes) != len(size) or any(
        o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, chunk_sizes, size)
    ):
        raise corrupt(index_path, f"the index places a chunk of {key!r} at offsets {list(offsets)}, sizes {list(chunk_sizes)}, outside its shape {list(size)}")
    info = storage.get(MetadataIndex(key, offsets))
    if info is None:
        raise corrupt(index_path, f"the index lists a chunk of {key!r} at offsets {list(offsets)} but no file holds it")
    path = _check_range(info, key, directory, sizes, records)
    needed = item.properties.dtype.itemsize * _numel(chunk_sizes)
    if info.length < needed and not getattr(info, "transform_descriptors", None):
        raise corrupt(
            path,
            f"the index gives the chunk of {key!r} at offsets {list(offsets)} {info.length} bytes, fewer than the "
            f"{needed} its shape {list(chunk_sizes)} of {item.properties.dtype} needs: the index disagrees with the shard",
        )


def _under(key: str, roots: set[str], planner_data: Any) -> bool:
    """Whether the flat index key ``key`` is one of ``roots`` or an item of a nested value saved under one."""
    path = (planner_data or {}).get(key, (key,)) if isinstance(planner_data, dict) else (key,)
    return key in roots or (bool(path) and str(path[0]) in roots)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count

"""DCP's index (``.metadata``) read as hostile input: scanned, unpickled with an allow-list, then every field checked.

torch 2.13's ``FileSystemReader.read_metadata`` (torch/distributed/checkpoint/filesystem.py) unpickles it
with a bare ``pickle.load``. Here, in order:

1. the file is opened as a regular file of the data directory (``safe_files``), at most ``MAX_INDEX_BYTES``;
2. ``pickle_guard.scan`` refuses deep nesting, amplification, ``BUILD`` on anything but a fresh instance of
   one of DCP's metadata classes with a state of that class's fields, and the opcodes DCP never writes;
3. ``IndexUnpickler`` unpickles it, importing only ``INDEX_GLOBALS`` and torch's dtypes;
4. ``index_checks.check_index`` checks the type and range of every field the loaders read.

Any failure raises ``CheckpointCorruptError`` (damage) or ``UnsafeCheckpointError`` (a global outside the
allow-list), naming the file and the field, before a single tensor is read.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from lightning_recsys.checkpoint.pickle_guard import PickleRefused, Policy, Value, scan
from lightning_recsys.checkpoint.safe_files import UnsafeCheckpointError, corrupt, data_root, read_whole

INDEX_FILE = ".metadata"
MAX_INDEX_BYTES = 1 << 30  # an index lists every chunk of every tensor: a few MB for large models

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
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
        _STORAGE_INFO,
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout: a lookup by name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id, the directory it was saved to
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
)

# The classes an index may instantiate and BUILD, with the fields their pickled state may set.
_BUILT = ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata")

_TRUSTED_HOW = (
    "If you trust this checkpoint as you would trust code, load it with trusted=True: load_checkpoint(), "
    "load_unsharded(), to_lightning_checkpoint() and export_safetensors() take it, as does "
    "load_from_checkpoint(..., trusted=True); under a Trainer, TwoDRecStrategy(checkpoint_io=DCPCheckpointIO(trusted=True))."
)


def _fields(module: str, name: str) -> tuple[set[str], set[str]]:
    """(every field, the required ones) of the dataclass ``module.name``."""
    cls = getattr(__import__(module, fromlist=[name]), name)
    every = {f.name for f in dataclasses.fields(cls)}
    required = {
        f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    return every, required


_BUILD_FIELDS: dict[tuple[str, str], tuple[set[str], set[str]]] = {
    **{(_DCP_METADATA, n): _fields(_DCP_METADATA, n) for n in _BUILT},
    _STORAGE_INFO: _fields(*_STORAGE_INFO),
}


def _check_build(name: tuple[str, str], state: Value) -> str | None:
    """A BUILD's state must be the fields of one of DCP's classes (TensorProperties: its 5-tuple)."""
    if name == (_DCP_METADATA, "TensorProperties"):
        return None if state.kind == "tuple" and len(state.keys) == 5 else "TensorProperties' state is not its 5 fields"
    if name not in _BUILD_FIELDS:
        return f"BUILD of a {'.'.join(name)}, which the index never builds"
    every, required = _BUILD_FIELDS[name]
    if state.kind != "dict" or any(k.text is None for k in state.keys):
        return f"the state of a {name[1]} is a {state.kind}, not a dict of its field names"
    keys = [k.text for k in state.keys]
    if len(set(keys)) != len(keys) or not set(keys) <= every or not required <= set(keys):  # type: ignore[arg-type]
        return f"the state of a {name[1]} sets {sorted(map(str, keys))[:8]}, not its fields {sorted(every)}"
    return None


INDEX_PICKLE = Policy(max_depth=24, weight_per_byte=8, check_build=_check_build)


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
    """Unpickle the DCP index file ``path`` (steps 1-4 above; 3 unrestricted if ``trusted``)."""
    from lightning_recsys.checkpoint.index_checks import check_index  # the field checks, kept in their own module

    require_trusted_bool(trusted)
    root = data_root(path.parent)
    where = root / path.name
    data = read_whole(root, path.name, what="the index file", limit=MAX_INDEX_BYTES)
    if not data:
        raise corrupt(where, "the index file is empty")
    if not trusted:
        try:
            scan(data, INDEX_PICKLE)
        except PickleRefused as error:
            raise corrupt(where, f"the index cannot be read ({error})") from error
    try:
        metadata = pickle.loads(data) if trusted else IndexUnpickler(io.BytesIO(data), path=where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever unpickling cut or overwritten bytes raises
        raise corrupt(where, f"the index cannot be read ({type(error).__name__}: {str(error)[:300]})") from error
    check_index(metadata, where, trusted=trusted)
    return metadata

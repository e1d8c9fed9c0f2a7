"""The ``torch.save`` records inside DCP's ``.distcp`` shards, read as hostile input.

A record is a zip archive. ``members`` refuses compressed or encrypted members (a 1 MiB DEFLATE
record can inflate to 1 GiB), members outside the record, and names ``torch.save`` does not write, so
that nothing read from a record is larger than the record. A tensor record is then read without
``torch.load``: its ``data.pkl`` passes ``pickle_guard.scan`` and a restricted unpickler that knows
only the tensor-rebuild call, one storage type and an empty ``OrderedDict``; its storage member
must hold exactly the elements the pickle declares, and the tensor must have the dtype and shape
the index gives its chunk (a record that points at another record of another shape is refused). A
byte item (a non-tensor value) is unpickled by ``torch.load(weights_only=True)``, after the same
zip checks and the same scan of its pickle.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from lightning_recsys.checkpoint.pickle_guard import PickleRefused, Policy, scan
from lightning_recsys.checkpoint.safe_files import CheckpointCorruptError, UnsafeCheckpointError, corrupt

# What torch.save writes inside its archive folder; nothing else is read (or accepted).
_KNOWN_MEMBERS = ("data.pkl", ".format_version", ".storage_alignment", "byteorder", "version", ".data/serialization_id")
_MAX_MEMBERS = 4096
_MAX_TENSOR_PICKLE = 1 << 16  # a tensor's data.pkl is about 150 bytes
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}

TENSOR_PICKLE = Policy(max_depth=8, weight_per_byte=4, persistent_ids=True, check_build=lambda name, state: "BUILD in a tensor record")
BYTE_ITEM_PICKLE = Policy(max_depth=64, weight_per_byte=8, persistent_ids=True, build_on_calls=True, mutable_calls=True)


def members(blob: bytes, *, where: str, what: str) -> dict[str, bytes]:
    """The members of the record ``blob`` by their name inside the archive folder; refuses anything unexpected."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        infos = archive.infolist()
    except Exception as error:  # noqa: BLE001 - zipfile on cut or overwritten bytes
        raise corrupt(where, f"{what} cannot be read: not a torch.save record ({type(error).__name__}: {error})") from error
    if not infos or len(infos) > _MAX_MEMBERS:
        raise corrupt(where, f"{what} has {len(infos)} zip members")
    folder = infos[0].filename.split("/", 1)[0]
    out: dict[str, bytes] = {}
    for info in infos:
        name = info.filename[len(folder) + 1 :] if info.filename.startswith(folder + "/") else None
        if name is None or name in out or not (name in _KNOWN_MEMBERS or (name.startswith("data/") and name[5:].isdigit())):
            raise corrupt(where, f"{what} holds the zip member {info.filename!r}, which torch.save does not write")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1 or info.file_size != info.compress_size:
            raise corrupt(where, f"{what}'s member {info.filename!r} is compressed or encrypted; checkpoint records are stored uncompressed")
        out[name] = _member_bytes(blob, info, where=where, what=what)
    if "data.pkl" not in out:
        raise corrupt(where, f"{what} has no data.pkl")
    if out.get("byteorder", b"little") != b"little":
        raise corrupt(where, f"{what} was written {out['byteorder'][:16]!r}-endian; this reader reads little-endian records")
    return out


def _member_bytes(blob: bytes, info: zipfile.ZipInfo, *, where: str, what: str) -> bytes:
    start = info.header_offset
    if start < 0 or start + _LOCAL_HEADER.size > len(blob):
        raise corrupt(where, f"{what}'s member {info.filename!r} starts outside the record")
    fields = _LOCAL_HEADER.unpack_from(blob, start)
    if fields[0] != b"PK\x03\x04" or fields[3] != zipfile.ZIP_STORED:
        raise corrupt(where, f"{what}'s member {info.filename!r} has no valid local header")
    name_length, extra_length = fields[9], fields[10]
    if blob[start + 30 : start + 30 + name_length] != info.filename.encode():
        raise corrupt(where, f"{what}'s member {info.filename!r} has another name in its local header")
    data_start = start + 30 + name_length + extra_length
    data_end = data_start + info.file_size
    if data_end > len(blob):
        raise corrupt(where, f"{what}'s member {info.filename!r} runs past the end of the record")
    return blob[data_start:data_end]


# ----------------------------------------------------------------- tensor records
@dataclass(frozen=True)
class _StorageRef:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _TensorSpec:
    storage: Any
    offset: Any
    size: Any
    stride: Any


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False, hooks: Any = None, *rest: Any) -> _TensorSpec:
    if rest or (hooks is not None and (not isinstance(hooks, collections.OrderedDict) or hooks)):
        raise PickleRefused("the tensor-rebuild call has arguments torch.save does not write")
    return _TensorSpec(storage, offset, size, stride)


class _GlobalRefused(PickleRefused):
    pass


class _TensorRecordUnpickler(pickle.Unpickler):
    """Knows the tensor-rebuild call, the storage types and ``OrderedDict``, and builds no tensor."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in STORAGE_DTYPES:
            return ("storage type", STORAGE_DTYPES[name])
        raise _GlobalRefused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise PickleRefused(f"a tensor record's storage reference {str(pid)[:80]!r}")
        _, storage_type, key, _location, numel = pid
        if not (isinstance(storage_type, tuple) and storage_type[:1] == ("storage type",)):
            raise PickleRefused("a tensor record's storage has no storage type")
        if not isinstance(key, str) or not key.isdigit() or type(numel) is not int or numel < 0:
            raise PickleRefused(f"a tensor record's storage key {key!r} or size {numel!r}")
        return _StorageRef(storage_type[1], key, numel)


def read_tensor_record(blob: bytes, *, where: str, what: str, dtype: torch.dtype, sizes: tuple[int, ...]) -> torch.Tensor:
    """The tensor of the record ``blob``, which must be a tensor of ``dtype`` and shape ``sizes``; built without torch.load."""
    parts = members(blob, where=where, what=what)
    pickled = parts["data.pkl"]
    if len(pickled) > _MAX_TENSOR_PICKLE:
        raise corrupt(where, f"{what}'s data.pkl has {len(pickled)} bytes, more than a tensor's")
    try:
        scan(pickled, TENSOR_PICKLE)
        spec = _TensorRecordUnpickler(io.BytesIO(pickled)).load()
    except _GlobalRefused as error:
        raise UnsafeCheckpointError(
            f"{where}: refused to unpickle the global {error} in {what}: a tensor record holds only a tensor, and "
            "loading this one could run code chosen by whoever wrote the file. Nothing was loaded."
        ) from error
    except PickleRefused as error:
        raise corrupt(where, f"{what} is not a plain tensor record: {error}") from error
    except Exception as error:  # noqa: BLE001 - whatever a damaged pickle raises
        raise corrupt(where, f"{what}'s data.pkl cannot be read ({type(error).__name__}: {error})") from error
    if not isinstance(spec, _TensorSpec) or not isinstance(spec.storage, _StorageRef):
        raise corrupt(where, f"{what} holds a {type(spec).__name__}, not a tensor")
    storage = spec.storage
    if storage.dtype != dtype:
        raise corrupt(where, f"{what} holds a tensor of {storage.dtype}, but the index gives its chunk {dtype}")
    if not (_ints(spec.size) and _ints(spec.stride) and len(spec.size) == len(spec.stride) and type(spec.offset) is int and spec.offset >= 0):
        raise corrupt(where, f"{what} has a malformed shape {spec.size!r}, stride {spec.stride!r} or offset {spec.offset!r}")
    if tuple(spec.size) != tuple(sizes):
        raise corrupt(where, f"{what} holds a tensor of shape {list(spec.size)}, but the index gives its chunk the shape {list(sizes)}")
    data = parts.get(f"data/{storage.key}")
    if data is None or len(data) != storage.numel * dtype.itemsize:
        raise corrupt(where, f"{what}'s storage holds {None if data is None else len(data)} bytes, not the {storage.numel * dtype.itemsize} its pickle declares")
    numel = 1
    for n in spec.size:
        numel *= n
    extent = spec.offset + sum((n - 1) * s for n, s in zip(spec.size, spec.stride)) + 1 if numel else 0
    if extent > storage.numel:
        raise corrupt(where, f"{what}'s shape and strides reach element {extent}, past its storage of {storage.numel}")
    flat = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
    return flat.as_strided(tuple(spec.size), tuple(spec.stride), spec.offset)


def _ints(values: Any) -> bool:
    return isinstance(values, tuple) and len(values) <= 64 and all(type(v) is int and v >= 0 for v in values)


# ----------------------------------------------------------------- byte items
def check_byte_record(blob: bytes, *, where: str, what: str) -> None:
    """The zip checks and the pickle scan of a byte item, before ``torch.load`` sees it."""
    parts = members(blob, where=where, what=what)
    try:
        scan(parts["data.pkl"], BYTE_ITEM_PICKLE)
    except PickleRefused as error:
        raise corrupt(where, f"{what} cannot be unpickled safely: {error}") from error


__all__ = ["CheckpointCorruptError", "check_byte_record", "members", "read_tensor_record"]

"""Small committed checkpoints of a tiny DLRM, written in one process, and the catalogue of damaged and hostile
ones (``DAMAGES``, ``HOSTILE``): for the checkpoint security tests and the checkpoint fuzzer (benchmarks/checkpoint_fuzz.py)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import torch
import torch.distributed.checkpoint as dcp

from lightning_recsys.checkpoint.directory import HOST_STATE_FILE, CheckpointMeta, commit, prepare_temporary
from lightning_recsys.data import SyntheticClickLog, SyntheticClickLogConfig
from lightning_recsys.models import DLRMRanker

CONFIG = SyntheticClickLogConfig(table_sizes=[11, 7], num_dense_features=3, global_batch_size=8, train_batches=1, val_batches=1, seed=3)


def ranker(seed: int) -> DLRMRanker:
    torch.manual_seed(seed)
    return DLRMRanker(
        table_sizes=CONFIG.table_sizes, num_dense_features=CONFIG.num_dense_features, embedding_dim=4,
        dense_arch_layer_sizes=[4, 4], over_arch_layer_sizes=[4, 1],
    )


def write_checkpoint(model: DLRMRanker, final: Path, host_state: dict) -> Path:
    """A committed checkpoint in the layout TwoDRecStrategy writes (one process, no process group)."""
    tmp = prepare_temporary(final)
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=tmp, no_dist=True)
    torch.save(host_state, tmp / HOST_STATE_FILE)
    meta = CheckpointMeta(step=5, world_size=2, sharding_group_size=2, num_replicas=1, layout="all_to_all_optimized", written_by_ranks=[0, 1])
    commit(tmp, final, meta)
    return final


def host_state(model: DLRMRanker, **extra: Any) -> dict[str, Any]:
    """The host state a Trainer's checkpoint holds, as far as loading it needs (Lightning reads its version key)."""
    return {"global_step": 5, "hyper_parameters": dict(model.hparams), "pytorch-lightning_version": lightning.__version__, **extra}


def predictions(model: DLRMRanker) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(SyntheticClickLog(CONFIG).global_batch("val", 0))


class SideEffect:
    """Unpickling this creates a directory: code a checkpoint's author chose, run by whoever loads it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.makedirs, (str(self.marker), 0o777, True))  # exist_ok: DCP itself may unpickle twice


class RankerWithExtraState(DLRMRanker):
    """A ranker with module extra state, which DCP saves as byte items (non-tensor values) in a .distcp file."""

    extra: Any = None

    def get_extra_state(self) -> Any:
        return {"vocab_version": 7} if self.extra is None else self.extra

    def set_extra_state(self, state: Any) -> None:
        self.restored_extra = state


def extra_state_ranker(seed: int) -> RankerWithExtraState:
    torch.manual_seed(seed)
    return RankerWithExtraState(
        table_sizes=CONFIG.table_sizes, num_dense_features=CONFIG.num_dense_features, embedding_dim=4,
        dense_arch_layer_sizes=[4, 4], over_arch_layer_sizes=[4, 1],
    )


def read_index_trusting(data: Path) -> Any:
    with open(data / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own file: what DCP's reader does


def edit_index(data: Path, edit: Callable[[Any], Any]) -> None:
    """Rewrite the checkpoint data directory ``data``'s index with ``edit`` applied (it may edit in place)."""
    metadata = read_index_trusting(data)
    edited = edit(metadata)
    (data / ".metadata").write_bytes(pickle.dumps(metadata if edited is None else edited))


def craft_index(data: Path, marker: Path) -> None:
    """An index whose unpickling creates ``marker``: a payload among the index's storage metadata."""
    def add(metadata: Any) -> None:
        metadata.storage_meta.modules = [SideEffect(marker)]
    edit_index(data, add)


def craft_byte_item(model: RankerWithExtraState, final: Path, marker: Path, host_state: dict) -> Path:
    """A checkpoint whose extra state (a byte item in a .distcp) holds a payload that creates ``marker`` when unpickled."""
    model.extra = {"vocab_version": SideEffect(marker)}
    try:
        return write_checkpoint(model, final, host_state)
    finally:
        model.extra = None


# ----------------------------------------------------------------- damage catalogue
def _storage(data: Path, *, key_part: str = "", bytes_item: bool = False) -> tuple[Any, Any]:
    """(MetadataIndex, _StorageInfo) of the first tensor chunk (or byte item) whose key contains ``key_part``."""
    metadata = read_index_trusting(data)
    for index, info in metadata.storage_data.items():
        is_bytes = index.offset is None
        if key_part in index.fqn and is_bytes == bytes_item:
            return index, info
    raise AssertionError(f"no storage entry with {key_part!r} in {data}")


def _shard(data: Path) -> Path:
    return data / _storage(data)[1].relative_path


def _overwrite(path: Path, offset: int, payload: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(payload)


def _drop_chunk_storage(metadata: Any) -> None:
    index = next(i for i in metadata.storage_data if i.offset is not None)
    del metadata.storage_data[index]


def _grow_a_tensor(metadata: Any) -> None:
    # 100 times the rows in the index, as if the shard held a larger table: the shard's record is too small.
    key, item = next((k, v) for k, v in metadata.state_dict_metadata.items() if "embedding_bags" in k and hasattr(v, "chunks"))
    item.size = torch.Size([item.size[0] * 100, *item.size[1:]])
    item.chunks[0].sizes = torch.Size([item.chunks[0].sizes[0] * 100, *item.chunks[0].sizes[1:]])


def _chunk_outside(metadata: Any) -> None:
    item = next(v for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks"))
    item.chunks[0].offsets = torch.Size([o + 1000 for o in item.chunks[0].offsets])


def _point_outside(metadata: Any) -> None:
    next(iter(metadata.storage_data.values())).relative_path = "../elsewhere.distcp"


def _corrupt_byte_item(data: Path) -> None:
    _, info = _storage(data, bytes_item=True)
    # Inside the record, past its zip header: the pickled value itself.
    path = data / info.relative_path
    raw = path.read_bytes()
    start = raw.index(b"\x80", raw.index(b"data.pkl", info.offset))  # the pickle's PROTO opcode
    _overwrite(path, start, b"\xff" * 24)


@dataclass(frozen=True)
class Damage:
    """One kind of damage to a committed checkpoint's data directory and the error it must raise."""

    name: str
    apply: Callable[[Path], None]
    file: str  # a regex for the file the error names
    problem: str  # a regex for the problem it names


DAMAGES: tuple[Damage, ...] = (
    Damage("index missing", lambda d: (d / ".metadata").unlink(), r"\.metadata", "the index file is missing"),
    Damage("index empty", lambda d: (d / ".metadata").write_bytes(b""), r"\.metadata", "the index file is empty"),
    Damage("index truncated", lambda d: (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:200]), r"\.metadata", "the index cannot be read"),
    Damage("index overwritten", lambda d: (d / ".metadata").write_bytes(b"\x00" * 64), r"\.metadata", "the index cannot be read"),
    Damage("index of another type", lambda d: (d / ".metadata").write_bytes(pickle.dumps({"step": 5})), r"\.metadata", "the index is a dict, not DCP's Metadata"),
    Damage("index lacks a chunk's storage", lambda d: edit_index(d, _drop_chunk_storage), r"\.metadata", "lists a chunk of .* but no file holds it"),
    Damage("index places a chunk outside its tensor", lambda d: edit_index(d, _chunk_outside), r"\.metadata", "outside its shape"),
    Damage("index names a file outside the checkpoint", lambda d: edit_index(d, _point_outside), r"\.metadata", "not a file name inside the checkpoint"),
    Damage("index sizes disagree with the shard", lambda d: edit_index(d, _grow_a_tensor), r"\.distcp", "fewer than the .* the index disagrees with the shard"),
    Damage("shard missing", lambda d: _shard(d).unlink(), r"\.distcp", "the shard file the index names is missing"),
    Damage("shard empty", lambda d: _shard(d).write_bytes(b""), r"\.distcp", "the shard file is truncated: .* the file has 0 bytes"),
    Damage("shard truncated", lambda d: _shard(d).write_bytes(_shard(d).read_bytes()[:-100]), r"\.distcp", "the shard file is truncated"),
    Damage("shard overwritten at an item", lambda d: _overwrite(_shard(d), _storage(d)[1].offset, b"\x00" * 8), r"\.distcp", "not a torch.save record"),
    Damage("byte item corrupted", _corrupt_byte_item, r"\.distcp", "the item .*_extra_state.*(cannot be (read|unpickled)|'s member .* has no valid local header)"),
    Damage("host state truncated", lambda d: (d / "host_state.pt").write_bytes((d / "host_state.pt").read_bytes()[:30]), r"host_state\.pt", "the file cannot be read"),
)


def corrupt_error_pattern(damage: Damage) -> str:
    return f"{damage.file}: .*{damage.problem}.*damaged.*nothing was loaded"


# ----------------------------------------------------------------- hostile catalogue (issue 52)
# Every kind of crafted or damaged checkpoint the loaders must refuse; each names the error type and the
# message (a regex after the file's path) it must raise on the load paths listed in ``paths``.
import io as _io
import stat as _stat
import zipfile as _zipfile

from lightning_recsys.checkpoint import CheckpointCorruptError, UnsafeCheckpointError

ALL_PATHS = ("load_unsharded", "to_lightning_checkpoint", "load_from_checkpoint", "export_safetensors", "warm_start")
HOST_STATE_PATHS = ALL_PATHS[:4]  # the warm start never reads host_state.pt
TABLE = "embedding_bags.t_sparse_0.weight"  # an 11 x 4 table
OTHER = "embedding_bags.t_sparse_1.weight"  # a 7 x 4 table
_METADATA_CLASS = b"ctorch.distributed.checkpoint.metadata\nMetadata\n"


@dataclass(frozen=True)
class Hostile:
    """One crafted or damaged checkpoint: how to make it from a committed data directory, and its refusal."""

    name: str
    apply: Callable[[Path], None]
    pattern: str  # regex over the error's message
    error: type = CheckpointCorruptError
    paths: tuple[str, ...] = ALL_PATHS


def _write_index(data: Path, payload: bytes) -> None:
    (data / ".metadata").write_bytes(payload)


def _entry(metadata: Any, part: str) -> Any:
    return next(v for k, v in metadata.state_dict_metadata.items() if part in k)


def _info(metadata: Any, part: str) -> Any:
    return next(v for i, v in metadata.storage_data.items() if part in i.fqn)


def _set_field(part: str, field: str, value: Any) -> Callable[[Path], None]:
    return lambda d: edit_index(d, lambda m: setattr(_info(m, part), field, value))


def _replace_record(data: Path, part: str, blob: bytes) -> None:
    """Append ``blob`` to the shard and point the index entry whose key contains ``part`` at it."""
    def edit(metadata: Any) -> None:
        info = _info(metadata, part)
        shard = data / info.relative_path
        info.offset, info.length = shard.stat().st_size, len(blob)
        with open(shard, "ab") as f:
            f.write(blob)
    edit_index(data, edit)


def _saved(value: Any) -> bytes:
    buffer = _io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _rezip(blob: bytes, *, compress: bool = False, extra: bool = False, cut_storage: bool = False) -> bytes:
    """A torch.save record rewritten: members DEFLATE-compressed, one extra member, or its storage cut short."""
    source = _zipfile.ZipFile(_io.BytesIO(blob))
    out = _io.BytesIO()
    with _zipfile.ZipFile(out, "w", compression=_zipfile.ZIP_DEFLATED if compress else _zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            content = source.read(info)
            if cut_storage and "/data/" in info.filename:
                content = content[:-4]
            target.writestr(info.filename, content)
        if extra:
            target.writestr(source.infolist()[0].filename.split("/")[0] + "/evil.py", b"print('hi')")
    return out.getvalue()


def _record_of(data: Path, part: str) -> bytes:
    info = _info(read_index_trusting(data), part)
    with open(data / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def _host_state(data: Path, edit: Callable[[dict], Any]) -> None:
    state = torch.load(data / HOST_STATE_FILE, weights_only=True)
    edited = edit(state)
    torch.save(state if edited is None else edited, data / HOST_STATE_FILE)


def _host_state_compressed(data: Path) -> None:
    (data / HOST_STATE_FILE).write_bytes(_rezip((data / HOST_STATE_FILE).read_bytes(), compress=True))


def _swap_for(data: Path, name: str, kind: str) -> None:
    """Replace the file ``name`` with a symlink to a copy outside the checkpoint, a FIFO or a directory."""
    path = data / name
    if kind == "symlink":
        outside = data.parent / f"outside-{name.strip('.')}"
        os.replace(path, outside)
        os.symlink(outside, path)
    else:
        path.unlink()
        os.mkfifo(path) if kind == "fifo" else path.mkdir()


def _shard_name(data: Path) -> str:
    return _info(read_index_trusting(data), TABLE).relative_path


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _overlapping_chunk(metadata: Any) -> None:
    item = _entry(metadata, TABLE)
    item.chunks.append(type(item.chunks[0])(offsets=torch.Size([1, 0]), sizes=torch.Size([1, 4])))


def _gap(metadata: Any) -> None:
    _entry(metadata, TABLE).chunks[0].sizes = torch.Size([10, 4])


def _huge_tensor(metadata: Any) -> None:
    _entry(metadata, TABLE).size = torch.Size([11 * 10**9, 4])  # 176 GB if allocated: the chunk covers 11 rows


def _other_records_range(metadata: Any) -> None:
    mine, other = _info(metadata, TABLE), _info(metadata, OTHER)
    mine.offset, mine.length = other.offset, other.length


def _point_at_byte_item(metadata: Any) -> None:
    mine, item = _info(metadata, TABLE), _info(metadata, "_extra_state")
    mine.offset, mine.length = item.offset, item.length


def _rename_nested_item(consistently: bool) -> Callable[[Any], None]:
    """Rename the extra state's nested item in the index: everywhere (a consistent index the model disagrees with), or
    only its entry (what a fuzzer's bit flip did: the planner data's path no longer names the entry)."""
    def edit(metadata: Any) -> None:
        old = next(k for k in metadata.state_dict_metadata if "_extra_state" in k)
        new = old.replace("vocab_version", "vocab_versioo")
        metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
        path = metadata.planner_data.pop(old)
        metadata.planner_data[new] = (path[0], "vocab_versioo") if consistently else path
        if consistently:
            index = next(i for i in metadata.storage_data if i.fqn == old)
            metadata.storage_data[type(index)(new)] = metadata.storage_data.pop(index)
    return edit


def _meta_json(data: Path, text: str) -> None:
    (data / "meta.json").write_text(text)


def _meta_edit(data: Path, **fields: Any) -> None:
    import json

    meta = json.loads((data / "meta.json").read_text())
    meta.update(fields)
    (data / "meta.json").write_text(json.dumps(meta))


_INDEX = r"\.metadata: .*"
_SHARD = r"\.distcp: .*"
_HOST = r"host_state\.pt: .*"
HOSTILE: tuple[Hostile, ...] = (
    # the index unpickler: nesting, amplification, BUILD, opcodes
    Hostile("index nested a million deep", lambda d: _write_index(d, b"\x80\x04N" + b"\x85" * 1_000_000 + b"."), _INDEX + "nest deeper than"),
    Hostile("index set of nested tuples", lambda d: _write_index(d, b"\x80\x04\x8f(N" + b"\x85" * 500_000 + b"\x90."), _INDEX + "nest deeper than"),
    Hostile("index BUILD sets a class attribute", lambda d: _write_index(d, b"\x80\x02" + _METADATA_CLASS + b"N}X\x04\x00\x00\x00evilK\x01s\x86b."), _INDEX + "BUILD on the class"),
    Hostile("index BUILD with fields the class lacks", lambda d: _write_index(d, b"\x80\x02" + _METADATA_CLASS + b")\x81}X\x08\x00\x00\x00__code__K\x01sb."), _INDEX + "not its fields"),
    Hostile("index memo reuse of a large list", lambda d: _write_index(d, b"\x80\x04c__builtin__\nfrozenset\n\x94]\x94(" + b"K\x01" * 20_000 + b"e" + b"h\x00h\x01\x85R0" * 3_000 + b"N."), _INDEX + "amplification"),
    Hostile("index exponential sharing", lambda d: _write_index(d, b"\x80\x04N" + b"2\x86" * 22 + b"."), _INDEX + "amplification"),
    Hostile("index a list inside itself", lambda d: _write_index(d, b"\x80\x04]q\x00h\x00a."), _INDEX + "changed after it was placed"),
    Hostile("index INST opcode", lambda d: _write_index(d, b"(ios\nsystem\n."), _INDEX + "opcode INST"),
    Hostile("index persistent id", lambda d: _write_index(d, b"\x80\x02X\x01\x00\x00\x00aQ."), _INDEX + "opcode BINPERSID"),
    Hostile("index string longer than the file", lambda d: _write_index(d, b"\x80\x04\x8d" + (2**62).to_bytes(8, "little") + b"abc."), _INDEX + "cannot be read"),
    # index fields of the wrong type or range
    Hostile("index chunk sizes a string", lambda d: edit_index(d, lambda m: setattr(_entry(m, TABLE).chunks[0], "sizes", "abc")), _INDEX + "not a shape"),
    Hostile("index chunk of the wrong rank", lambda d: edit_index(d, lambda m: setattr(_entry(m, TABLE).chunks[0], "offsets", torch.Size([0]))), _INDEX + "dimensions"),
    Hostile("index negative offset", _set_field(TABLE, "offset", -5), _INDEX + "not a non-negative integer"),
    Hostile("index file name not a string", _set_field(TABLE, "relative_path", 7), _INDEX + "not a file name inside the checkpoint"),
    Hostile("index transform descriptors", _set_field(TABLE, "transform_descriptors", ["zstd"]), _INDEX + "transform_descriptors"),
    Hostile("index planner data malformed", lambda d: edit_index(d, lambda m: setattr(m, "planner_data", {"x": 5})), _INDEX + "planner_data"),
    Hostile("index entry key not a string", lambda d: edit_index(d, lambda m: m.state_dict_metadata.__setitem__(5, _entry(m, TABLE))), _INDEX + "not a tensor or bytes entry"),
    Hostile("index entries a list", lambda d: edit_index(d, lambda m: setattr(m, "state_dict_metadata", [])), _INDEX + "lacks its state_dict_metadata"),
    Hostile("index storage key a string", lambda d: edit_index(d, lambda m: m.storage_data.__setitem__("x", _info(m, TABLE))), _INDEX + "storage entry"),
    Hostile("index dtype of another record", lambda d: edit_index(d, lambda m: setattr(_entry(m, TABLE).properties, "dtype", torch.int32)), _SHARD + "float32, but the index gives its chunk torch.int32"),
    # geometry: chunks tile their tensor; records hold what the index says
    Hostile("index chunks overlap", lambda d: edit_index(d, _overlapping_chunk), _INDEX + "overlap"),
    Hostile("index chunks leave a gap", lambda d: edit_index(d, _gap), _INDEX + "cover 40 of its 44 elements"),
    Hostile("index declares a huge tensor", lambda d: edit_index(d, _huge_tensor), _INDEX + "cover 44 of its"),
    Hostile("index points at a record of another shape", lambda d: edit_index(d, _other_records_range), _SHARD + r"holds a tensor of shape \[7, 4\].*\[11, 4\]"),
    Hostile("index points a tensor at a byte item", lambda d: edit_index(d, _point_at_byte_item), _SHARD + "(not a tensor|not a plain tensor record|holds a)"),
    Hostile("index planner path not its entry's", lambda d: edit_index(d, _rename_nested_item(False)), _INDEX + "planner_data.*not that entry's"),
    Hostile("index renames a nested item", lambda d: edit_index(d, _rename_nested_item(True)), _INDEX + r"lacks \['model\._extra_state\.vocab_version'\]",
            paths=("load_unsharded",)),
    # files that are not what they seem
    Hostile("index a symlink", lambda d: _swap_for(d, ".metadata", "symlink"), _INDEX + "symbolic link"),
    Hostile("index a FIFO", lambda d: _swap_for(d, ".metadata", "fifo"), _INDEX + "FIFO"),
    Hostile("index a directory", lambda d: _swap_for(d, ".metadata", "dir"), _INDEX + "directory"),
    Hostile("shard a symlink", lambda d: _swap_for(d, _shard_name(d), "symlink"), _SHARD + "symbolic link"),
    Hostile("shard a FIFO", lambda d: _swap_for(d, _shard_name(d), "fifo"), _SHARD + "FIFO"),
    Hostile("host state a symlink", lambda d: _swap_for(d, HOST_STATE_FILE, "symlink"), _HOST + "symbolic link", paths=HOST_STATE_PATHS),
    Hostile("host state a FIFO", lambda d: _swap_for(d, HOST_STATE_FILE, "fifo"), _HOST + "FIFO", paths=HOST_STATE_PATHS),
    Hostile("meta.json a FIFO", lambda d: _swap_for(d, "meta.json", "fifo"), r"meta\.json cannot be read"),
    Hostile("meta.json a symlink", lambda d: _swap_for(d, "meta.json", "symlink"), r"meta\.json cannot be read"),
    Hostile("meta.json nested deep", lambda d: _meta_json(d, "[" * 200_000 + "]" * 200_000), r"meta\.json cannot be read"),
    Hostile("meta.json huge number", lambda d: _meta_json(d, '{"step": 1' + "0" * 10_000 + "}"), r"meta\.json cannot be read"),
    Hostile("meta.json field of the wrong type", lambda d: _meta_edit(d, tables=[1, 2]), r"meta\.json has tables of type list"),
    # tensor and byte records
    Hostile("record compressed", lambda d: _replace_record(d, TABLE, _rezip(_record_of(d, TABLE), compress=True)), _SHARD + "compressed"),
    Hostile("record with an extra member", lambda d: _replace_record(d, TABLE, _rezip(_record_of(d, TABLE), extra=True)), _SHARD + "which torch.save does not write"),
    Hostile("record storage cut short", lambda d: _replace_record(d, TABLE, _rezip(_record_of(d, TABLE), cut_storage=True)), _SHARD + "storage holds 172 bytes, not the 176"),
    Hostile("record of a non-tensor", lambda d: _replace_record(d, TABLE, _saved(5)), _SHARD + "(not a tensor|holds a int)"),
    Hostile("record of another shape", lambda d: _replace_record(d, TABLE, _saved(torch.zeros(3))), _SHARD + r"holds a tensor of shape \[3\]"),
    Hostile("byte item nested deep", lambda d: _replace_record(d, "_extra_state", _saved(_nested(300))), _SHARD + "nest deeper than"),
    Hostile("byte item compressed", lambda d: _replace_record(d, "_extra_state", _rezip(_record_of(d, "_extra_state"), compress=True)), _SHARD + "compressed"),
    # host_state.pt: plain data that directs the load
    Hostile("host state reshape record grows a table", lambda d: _host_state(d, lambda s: s.__setitem__(
        "lightning_recsys_reshaped_tables", [{"table": "t_sparse_0", "rows": 11, "dim": 4, "new_rows": 10**9, "new_dim": 4}])),
        _HOST + "another number of elements", paths=HOST_STATE_PATHS),
    Hostile("host state reshape record malformed", lambda d: _host_state(d, lambda s: s.__setitem__("lightning_recsys_reshaped_tables", "lots")),
        _HOST + "not a list of tables", paths=HOST_STATE_PATHS),
    Hostile("host state nested deep", lambda d: _host_state(d, lambda s: s.__setitem__("x", _nested(300))), _HOST + "nest deeper than", paths=HOST_STATE_PATHS),
    Hostile("host state compressed", _host_state_compressed, _HOST + "compressed", paths=HOST_STATE_PATHS),
    Hostile("host state not a dict", lambda d: _host_state(d, lambda s: [1, 2]), _HOST + "not the trainer state's dict", paths=HOST_STATE_PATHS),
)

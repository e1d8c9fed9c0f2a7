"""Small committed checkpoints of a tiny DLRM, written in one process, for the checkpoint security tests."""

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

"""Saving and loading sharded state with PyTorch Distributed Checkpoint (DCP), Trainer-free.

Every function here that takes a ``topology`` is collective: every rank calls it, at the same
point. Only sharding group 0 (``topology.writer_group``) writes the tables, so replicas do
not write duplicates; every sharding group reads with its own process group, so a checkpoint
loads into any topology, world size and plan. See ``directory`` for the files and the commit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import StorageWriter

from lightning_recsys.checkpoint.directory import (
    HOST_STATE_FILE,
    CheckpointMeta,
    UncommittedCheckpointError,
    checkpoint_path,
    commit,
    prepare_temporary,
    read_meta,
    resolve,
    software_versions,
    temporary_path,
    utc_now,
)
from lightning_recsys.checkpoint.safe_reading import (
    INDEX_FILE,
    CheckpointCorruptError,
    UnsafeCheckpointError,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_flattened_keys,
    check_storage,
    preload_byte_items,
    read_host_state,
    read_index,
)
from lightning_recsys.checkpoint.table_state import EmbeddingOptimizerState, StateReads, TablePlacement, table_name
from lightning_recsys.checkpoint.validation import (
    check_entries,
    model_entries,
    model_key,
    optimizer_entries,
    saved_tensors,
)
from lightning_recsys.checkpoint.write_errors import explain_write_error
from lightning_recsys.parallel.sharding import EmbeddingOptimizerConfig, ShardedModel, plan_rows
from lightning_recsys.parallel.topology import ParallelTopology

StorageWriterFactory = Callable[[Path], StorageWriter]


class CheckpointError(RuntimeError):
    """A save or load failed on another rank; this rank stopped with it so that no rank hangs."""


def default_storage_writer(path: Path) -> StorageWriter:
    """DCP's file writer: one file per rank, fsynced (the commit marker must not outrun the data)."""
    return FileSystemWriter(path, single_file_per_rank=True, sync_files=True, overwrite=True)


@dataclass(kw_only=True)
class ShardedState:
    """One rank's state that goes through DCP: the model state dict and the embedding optimizer state.

    Args:
        model_state_dict: the state dict of the sharded module (``ShardedModel.dmp.module``, e.g. the
            LightningModule): ShardedTensors for model-parallel tables, tensors for the rest. Loading
            writes into its tensors in place, so they must share storage with the module, as
            ``module.state_dict()``'s do.
        sharded_model: what ``shard_model`` returned (the tables, plan and fused optimizer).
        embedding_optimizer: the config the tables' optimizers were made from.
        data_parallel_table_optimizer: the torch optimizer of the data_parallel tables, if any.
    """

    model_state_dict: dict[str, Any]
    sharded_model: ShardedModel
    embedding_optimizer: EmbeddingOptimizerConfig
    data_parallel_table_optimizer: torch.optim.Optimizer | None = None

    def table_placements(self) -> dict[str, TablePlacement]:
        """Weight key -> placement, for every embedding table of the sharded module."""
        fqns = self.sharded_model.embedding_module_fqns
        placements: dict[str, TablePlacement] = {}
        for key, value in self.model_state_dict.items():
            if isinstance(value, torch.Tensor) and any(fqn == "" or key.startswith(fqn + ".") for fqn in fqns):
                placements[key] = TablePlacement.of(key, value)
        return placements

    def embedding_optimizer_state(self, process_group: dist.ProcessGroup | None) -> EmbeddingOptimizerState:
        module = self.sharded_model.dmp.module
        data_parallel_ids = {id(p) for p in self.sharded_model.data_parallel_table_params}
        data_parallel_params = {name: p for name, p in module.named_parameters() if id(p) in data_parallel_ids}
        fused = self.sharded_model.fused_optimizer.state_dict()["state"]
        return EmbeddingOptimizerState(
            optimizer_name=self.embedding_optimizer.name,
            tables=self.table_placements(),
            fused_state={key: list(states.items()) for key, states in fused.items()},
            data_parallel_optimizer=self.data_parallel_table_optimizer,
            data_parallel_params=data_parallel_params,
            process_group=process_group,
        )


@dataclass(frozen=True, kw_only=True)
class LoadedCheckpoint:
    """What a load returns besides the state it wrote in place.

    Args:
        path: the checkpoint directory.
        meta: its ``meta.json``.
        host_state: the trainer state global rank 0 saved (None if none was saved).
    """

    path: Path
    meta: CheckpointMeta
    host_state: dict[str, Any] | None


# ----------------------------------------------------------------- save
def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    state: ShardedState,
    topology: ParallelTopology,
    host_state: Mapping[str, Any] | None = None,
    step: int | None = None,
    extra_meta: Mapping[str, Any] | None = None,
    storage_writer_factory: StorageWriterFactory = default_storage_writer,
) -> Path:
    """Save a checkpoint to the directory ``path``, atomically; every rank calls it. Returns ``path``.

    Sharding group 0 writes the model and embedding optimizer state with ``dcp.save`` over its
    process group; global rank 0 writes ``host_state`` with ``torch.save``. After every rank has
    finished, rank 0 writes ``meta.json`` and the commit marker and swaps ``path`` (a symlink to the
    data directory) onto the new copy in one ``os.replace`` (an existing checkpoint there is replaced;
    see ``directory`` for the protocol). A failure on any rank raises on every rank and leaves no
    committed checkpoint behind. ``step`` orders ``latest_checkpoint``;
    ``extra_meta`` (JSON-serializable) goes into ``meta.json``.
    """
    final = Path(path)
    prepared = _prepare_save(final, state=state, topology=topology, step=step, extra_meta=extra_meta)
    error: BaseException | None = None
    try:
        _write_host_state(prepared.tmp, host_state)
        if prepared.dcp_state is not None:
            dcp.save(
                prepared.dcp_state,
                storage_writer=storage_writer_factory(prepared.tmp),
                process_group=topology.sharding_process_group(),
            )
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn about it (DCP's is a BaseException)
        error = explain_write_error(e, final=final, tmp=prepared.tmp)
    _all_ranks_ok(error, action=f"writing checkpoint {str(prepared.tmp)!r}")
    _commit_on_rank_zero(prepared)
    return final


@dataclass
class _PreparedSave:
    final: Path
    tmp: Path
    dcp_state: dict[str, Any] | None  # None on ranks outside sharding group 0
    meta: CheckpointMeta | None  # global rank 0 only


def _prepare_save(
    final: Path,
    *,
    state: ShardedState,
    topology: ParallelTopology,
    step: int | None,
    extra_meta: Mapping[str, Any] | None,
) -> _PreparedSave:
    _require_process_group("save_checkpoint")
    rank = dist.get_rank()
    prepared = _PreparedSave(final=final, tmp=temporary_path(final), dcp_state=None, meta=None)
    error: Exception | None = None
    try:
        if rank == 0:
            prepare_temporary(final)
        if rank in topology.writer_group:
            optimizer_state = state.embedding_optimizer_state(topology.sharding_process_group())
            prepared.dcp_state = {model_key(k): v for k, v in state.model_state_dict.items()}
            prepared.dcp_state.update(optimizer_state.state_dict_for_save())
            if rank == 0:
                prepared.meta = _build_meta(state, optimizer_state, topology, step, extra_meta)
    except Exception as e:  # noqa: BLE001
        error = e
    # Agree before DCP's own collectives, so a rank that failed here cannot leave the others waiting.
    _all_ranks_ok(error, action=f"preparing checkpoint {str(final)!r}")
    return prepared


def _commit_on_rank_zero(prepared: _PreparedSave) -> None:
    error: Exception | None = None
    try:
        if dist.get_rank() == 0:
            assert prepared.meta is not None
            prepared.meta.saved_at = utc_now()
            commit(prepared.tmp, prepared.final, prepared.meta)
    except Exception as e:  # noqa: BLE001
        error = e
    _all_ranks_ok(error, action=f"committing checkpoint {str(prepared.final)!r}")


def _write_host_state(tmp: Path, host_state: Mapping[str, Any] | None) -> None:
    if dist.get_rank() == 0 and host_state is not None:
        with open(tmp / HOST_STATE_FILE, "wb") as f:
            torch.save(dict(host_state), f)
            f.flush()
            os.fsync(f.fileno())


def in_module(key: str, module: str) -> bool:
    """Whether state-dict ``key`` lies under module path ``module`` (``"ebc2.x"`` is not under ``"ebc"``; ``""`` is the root)."""
    return not module or key.startswith(module + ".")


def _build_meta(
    state: ShardedState,
    optimizer_state: EmbeddingOptimizerState,
    topology: ParallelTopology,
    step: int | None,
    extra_meta: Mapping[str, Any] | None,
) -> CheckpointMeta:
    rows = plan_rows(state.sharded_model.plan)
    sharding_types = {(str(r["module"]), str(r["table"])): r["sharding_type"] for r in rows}
    tables = {}
    for key, placement in optimizer_state.tables.items():
        name = table_name(key)
        sharding_type = next((t for (module, table), t in sharding_types.items() if table == name and in_module(key, module)), None)
        tables[key] = {"table": name, "shape": [placement.rows, placement.dim], "sharding_type": sharding_type}
    return CheckpointMeta(
        step=step,
        world_size=topology.world_size,
        sharding_group_size=topology.sharding_group_size,
        num_replicas=topology.num_replicas,
        layout=topology.layout,
        written_by_ranks=list(topology.writer_group),
        plan=rows,
        tables=tables,
        embedding_optimizer={"name": state.embedding_optimizer.name, "states": list(optimizer_state.states)},
        versions=software_versions(),
        extra=dict(extra_meta or {}),
    )


# ----------------------------------------------------------------- load
def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    state: ShardedState,
    topology: ParallelTopology,
    strict: bool = True,
    load_embedding_optimizer_state: bool = True,
    weights_only: bool | None = None,
    require_host_state: bool = False,
    trusted: bool = False,
) -> LoadedCheckpoint:
    """Load a committed checkpoint into ``state`` in place, resharding as needed; every rank calls it.

    Before any read, every rank checks the checkpoint's keys and global shapes against ``state``
    and raises ``CheckpointMismatchError`` (a ValueError) naming each table/key and both shapes;
    an uncommitted directory raises ``UncommittedCheckpointError`` (a ValueError). Each sharding
    group then reads with its own process group. ``strict=False`` skips keys present on one side
    only; ``load_embedding_optimizer_state=False`` leaves the embedding optimizer as it is.
    ``weights_only`` is passed to ``torch.load`` for the host state; ``require_host_state=True`` refuses
    a checkpoint without one (a Trainer's resume needs it). Returns the host state and meta.

    Loading runs no code from the checkpoint (see ``safe_reading``): a global in the index or in a
    non-tensor item other than DCP's own raises ``UnsafeCheckpointError``, unless ``trusted=True``
    (for a checkpoint trusted as code). A damaged file (index, shard or host state) raises
    ``CheckpointCorruptError`` naming it. Both are raised on every rank before anything is written.
    """
    _require_process_group("load_checkpoint")
    directory = checkpoint_path(path)
    group = topology.sharding_process_group()
    targets: dict[str, Any] = {}
    reads: StateReads | None = None
    meta: CheckpointMeta | None = None
    host_state: dict[str, Any] | None = None
    error: Exception | None = None
    try:
        directory = resolve(directory)  # the newest committed copy of this name (see directory.py)
        meta = read_meta(directory)
        metadata = read_index(directory / INDEX_FILE, trusted=trusted)
        check_storage(metadata, directory)  # every shard file against the index
        # Read before the shards: a damaged host state must fail on every rank before the model changes.
        host_state = read_host_state(directory, weights_only)
        if host_state is None and require_host_state:
            raise UncommittedCheckpointError(
                f"checkpoint {str(directory)!r} has no {HOST_STATE_FILE} (the trainer state a resume needs); it was "
                "saved without host_state, or the file was deleted. Load it with load_checkpoint()/load_unsharded() instead."
            )
        optimizer_state = state.embedding_optimizer_state(group) if load_embedding_optimizer_state else None
        expected = model_entries(state.model_state_dict, set(state.table_placements()))
        if optimizer_state is not None:
            expected += optimizer_entries(optimizer_state)
        # A refused or damaged byte item fails first, before any comparison and before DCP copies any tensor.
        preload_byte_items(metadata, directory, keys={e.key for e in expected}, trusted=trusted)
        to_load = check_entries(
            expected,
            metadata,
            path=directory,
            strict=strict,
            optimizer_name=state.embedding_optimizer.name,
            saved_optimizer=meta.embedding_optimizer,
        )
        loadable = {e.key for e in to_load}
        targets = {model_key(k): v for k, v in state.model_state_dict.items() if model_key(k) in loadable}
        if optimizer_state is not None:
            saved = {k: v for k, v in saved_tensors(metadata).items() if k in loadable}  # strict=False may skip some
            reads = optimizer_state.plan_reads(saved, default_step=float(meta.step or 0))
            targets.update(reads.targets)
        check_flattened_keys(targets, metadata, directory)  # on every rank before any read, as DCP's planner will ask
    except Exception as e:  # noqa: BLE001
        error = e
    _all_ranks_ok(error, action=f"validating checkpoint {str(directory)!r}")
    assert meta is not None
    _read_shards(targets, directory, trusted=trusted, metadata=metadata, process_group=group)
    for key, value in state.model_state_dict.items():
        if not isinstance(value, torch.Tensor) and model_key(key) in targets:
            state.model_state_dict[key] = targets[model_key(key)]  # DCP replaces non-tensor values
    if reads is not None:
        reads.apply()
    return LoadedCheckpoint(path=directory, meta=meta, host_state=host_state)


def _read_shards(
    targets: dict[str, Any], directory: Path, *, trusted: bool, metadata: Metadata | None = None, **kwargs: Any
) -> None:
    """``dcp.load`` through the safe reader and planner; a failure becomes one error naming the checkpoint (on every rank).

    ``check_storage`` has held every record against the index already, so this fails only if a file
    changes in between or cannot be read. ``metadata``: the checked index, handed to DCP as it is.
    """
    if metadata is not None:
        check_flattened_keys(targets, metadata, directory)
    reader = SafeFileSystemReader(directory, trusted=trusted, metadata=metadata)
    try:
        dcp.load(targets, storage_reader=reader, planner=SafeLoadPlanner(trusted=trusted), **kwargs)
    except CheckpointException as error:
        # DCP keeps (exception, traceback) per failed rank.
        causes = {r: f[0] if isinstance(f, tuple) else f for r, f in sorted(error.failures.items())}
        ours = [e for e in causes.values() if isinstance(e, (CheckpointCorruptError, UnsafeCheckpointError))]
        if reader.copied == 0 and ours and len(ours) == len(causes):
            raise ours[0] from error  # refused before this rank's model changed: the refusal names file and field
        failures = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in causes.items())
        state = (
            "The model is partly overwritten: load another checkpoint."
            if reader.copied
            else "Nothing was copied into this rank's model; other ranks may have loaded part of theirs."
        )
        raise CheckpointError(
            f"reading the shards of checkpoint {str(directory)!r} failed ({failures}); the checkpoint is damaged (a "
            f"truncated or deleted .distcp file, or one changed during the load). {state}"
        ) from error


# ----------------------------------------------------------------- agreement between ranks
def _all_ranks_ok(error: BaseException | None, *, action: str) -> None:
    """Every rank learns whether every rank succeeded at ``action`` (an all-gather over WORLD).

    Bounded by the default process group's timeout. The rank that failed re-raises its own
    error; the others raise ``CheckpointError`` naming the ranks that failed and why.
    """
    statuses: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = {rank: message for rank, message in enumerate(statuses) if message is not None}
    if failed:
        first = min(failed)
        raise CheckpointError(
            f"{action} failed on rank(s) {sorted(failed)}; rank {first}: {failed[first]}"
        )


def _require_process_group(caller: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{caller}() is collective and needs an initialized default process group on every rank; for a "
            "single process without one, use load_unsharded()."
        )


__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "ShardedState",
    "default_storage_writer",
    "load_checkpoint",
    "save_checkpoint",
]

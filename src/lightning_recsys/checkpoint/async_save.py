"""Saving a checkpoint in the background with ``dcp.async_save``: training goes on while it is written."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_recsys.checkpoint.dcp_io import (
    ShardedState,
    StorageWriterFactory,
    _all_ranks_ok,
    _commit_on_rank_zero,
    _prepare_save,
    _PreparedSave,
    _require_process_group,
    _write_host_state,
    default_storage_writer,
)
from lightning_recsys.parallel.topology import ParallelTopology


class AsyncCheckpointSaver:
    """Saves with ``dcp.async_save`` in a background thread; at most one save in flight.

    Creating it is collective (every rank): it makes a gloo process group over sharding group 0
    for the background writes, because DCP's background collectives must not share a process
    group with training's (the two threads would interleave their collectives).
    """

    def __init__(self, topology: ParallelTopology, *, timeout: timedelta | None = None) -> None:
        _require_process_group("AsyncCheckpointSaver")
        self._topology = topology
        # timeout: the job's; without it gloo's default (30 min) bounds a background write to a lost peer.
        self._group = dist.new_group(topology.writer_group, backend="gloo", timeout=timeout)
        self._pending: AsyncCheckpointHandle | None = None

    def save(
        self,
        path: str | os.PathLike[str],
        *,
        state: ShardedState,
        host_state: Mapping[str, Any] | None = None,
        step: int | None = None,
        extra_meta: Mapping[str, Any] | None = None,
        storage_writer_factory: StorageWriterFactory = default_storage_writer,
    ) -> AsyncCheckpointHandle:
        """Start saving to ``path`` (see ``save_checkpoint``); every rank calls it and later ``wait()``.

        Returns once the state is copied (staged) to CPU memory, so training may change it; the
        checkpoint is committed only by ``handle.wait()`` (or the next ``save``/``wait`` here).
        """
        self.wait()
        prepared = _prepare_save(Path(path), state=state, topology=self._topology, step=step, extra_meta=extra_meta)
        future: Future[Any] | None = None
        error: Exception | None = None
        try:
            _write_host_state(prepared.tmp, host_state)
            if prepared.dcp_state is not None:
                result = dcp.async_save(
                    prepared.dcp_state, storage_writer=storage_writer_factory(prepared.tmp), process_group=self._group
                )
                if isinstance(result, Future):  # staged already (FileSystemWriter stages before returning)
                    future = result
                else:  # a stager that stages in the background: training must not run ahead of the copy
                    result.staging_completion.result()
                    future = result.upload_completion
        except Exception as e:  # noqa: BLE001
            error = e
        _all_ranks_ok(error, action=f"starting the async save of {str(prepared.tmp)!r}")
        self._pending = AsyncCheckpointHandle(prepared=prepared, future=future)
        return self._pending

    def wait(self) -> Path | None:
        """Finish and commit the save in flight, if any (every rank calls it); its path, or None."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else None

    def close(self) -> None:
        """Finish the save in flight and release the process group (every rank calls it)."""
        self.wait()
        if self._group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
            dist.destroy_process_group(self._group)
        self._group = None


@dataclass
class AsyncCheckpointHandle:
    """A save in flight. ``wait()`` on every rank commits it."""

    prepared: _PreparedSave
    future: Future[Any] | None
    _committed: bool = field(default=False)

    @property
    def path(self) -> Path:
        return self.prepared.final

    def wait(self) -> Path:
        """Wait for every rank's write, then commit (rank 0 swaps the name); collective. Returns the path."""
        if self._committed:
            return self.path
        error: Exception | None = None
        try:
            if self.future is not None:
                self.future.result()
        except Exception as e:  # noqa: BLE001
            error = e
        self._committed = True  # a failed save is not retried
        _all_ranks_ok(error, action=f"writing checkpoint {str(self.prepared.tmp)!r} in the background")
        _commit_on_rank_zero(self.prepared)
        return self.path

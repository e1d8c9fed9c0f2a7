"""The on-disk layout of a checkpoint directory and its commit protocol. No collectives here.

A checkpoint is one directory::

    <name>/
        .metadata            DCP's index: every key's global shape and where its chunks are
        __<r>_<i>.distcp     DCP's data files, written by the ranks of sharding group 0
        host_state.pt        trainer state (torch.save by global rank 0)
        meta.json            human-readable description (CheckpointMeta)
        COMMITTED            commit marker, written last

It is written as ``.partial-<hash of name>`` and renamed to ``<name>`` by global rank 0 after
every rank has finished. A directory without the marker is never a checkpoint (``is_committed``).
The temporary names do not contain ``<name>``, so a search by name (Lightning's ``ckpt_path="last"``
looks for "last" in the names) never finds a partial save.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

FORMAT = "lightning_recsys.dcp"
FORMAT_VERSION = 1
META_FILE = "meta.json"
MARKER_FILE = "COMMITTED"
HOST_STATE_FILE = "host_state.pt"
TMP_PREFIX = ".partial-"
OLD_PREFIX = ".replaced-"

_VERSIONED_DISTRIBUTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch", ("torch",)),
    ("torchrec", ("torchrec",)),
    ("fbgemm_gpu", ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly")),
    ("lightning_recsys", ("lightning-recsys",)),
)


class UncommittedCheckpointError(ValueError):
    """The directory is not a committed checkpoint (missing, partial, or from an interrupted save)."""


@dataclass(kw_only=True)
class CheckpointMeta:
    """The contents of ``meta.json``: what was saved, by which topology and software.

    Args:
        step: the training step the caller recorded (orders ``latest_checkpoint``); None if unknown.
        world_size, sharding_group_size, num_replicas, layout: the topology that saved it.
        written_by_ranks: the global ranks that wrote the tables (sharding group 0).
        plan: ``planner.plan_rows(plan)`` of the saving run (group-local ranks).
        tables: embedding table weight key -> ``{"table", "shape", "sharding_type"}``.
        embedding_optimizer: ``{"name": ..., "states": [...]}``, the normalized states saved per table.
        versions: torch, torchrec, fbgemm_gpu and lightning_recsys versions.
        saved_at: UTC time of the commit, ISO 8601.
        extra: anything the caller added (JSON-serializable).
    """

    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    step: int | None = None
    world_size: int
    sharding_group_size: int
    num_replicas: int
    layout: str
    written_by_ranks: list[int]
    plan: list[dict[str, Any]] = field(default_factory=list)
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    embedding_optimizer: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str | None] = field(default_factory=dict)
    saved_at: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: Path) -> CheckpointMeta:
        if data.get("format") != FORMAT:
            raise UncommittedCheckpointError(
                f"{source} has format={data.get('format')!r}, not {FORMAT!r}: it was not written by "
                "lightning_recsys.checkpoint."
            )
        version = data.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise UncommittedCheckpointError(
                f"{source} has format_version={version!r}; this lightning_recsys reads versions <= "
                f"{FORMAT_VERSION}. Upgrade lightning_recsys to load it."
            )
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def software_versions() -> dict[str, str | None]:
    """Installed versions of the packages a checkpoint depends on (None where not installed)."""
    versions: dict[str, str | None] = {}
    for key, distributions in _VERSIONED_DISTRIBUTIONS:
        versions[key] = None
        for distribution in distributions:
            try:
                versions[key] = importlib_metadata.version(distribution)
                break
            except importlib_metadata.PackageNotFoundError:
                continue
    return versions


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def is_committed(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a directory holding a commit marker (written last by a finished save)."""
    return (Path(path) / MARKER_FILE).is_file()


def read_meta(path: str | os.PathLike[str]) -> CheckpointMeta:
    """The ``meta.json`` of a committed checkpoint; raises ``UncommittedCheckpointError`` otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise UncommittedCheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a directory).")
    if not is_committed(path):
        raise UncommittedCheckpointError(
            f"{str(path)!r} is not a committed checkpoint: it has no {MARKER_FILE} marker, so its save never "
            "finished (a crash or a save still in progress). Load an earlier checkpoint, e.g. "
            "latest_checkpoint(parent_directory), which skips uncommitted directories."
        )
    try:
        data = json.loads((path / META_FILE).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UncommittedCheckpointError(f"{path / META_FILE} cannot be read ({error}); the checkpoint is damaged.") from error
    return CheckpointMeta.from_dict(data, source=path)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint directly inside ``directory``, or None if there is none.

    Directories without the commit marker (partial saves) are skipped. Order: the ``step`` in
    ``meta.json`` (a checkpoint without a step sorts before any with one), then ``saved_at``, then
    the marker's mtime, then the name. A save interrupted between its two renames leaves its
    complete, committed copy at its temporary name; that copy is a valid checkpoint and is
    returned if it is the newest.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    candidates: list[tuple[tuple[int, int, str, float, str], Path]] = []
    for child in directory.iterdir():
        if not child.is_dir() or not is_committed(child):
            continue
        try:
            meta = read_meta(child)
        except UncommittedCheckpointError:
            continue  # a damaged meta.json: not a checkpoint we can order or load
        has_step = int(meta.step is not None)
        key = (has_step, meta.step or 0, meta.saved_at, (child / MARKER_FILE).stat().st_mtime, child.name)
        candidates.append((key, child))
    return max(candidates)[1] if candidates else None


# ----------------------------------------------------------------- rank-0 file operations
def temporary_path(final: Path) -> Path:
    return final.with_name(TMP_PREFIX + _name_hash(final))


def _aside_path(final: Path) -> Path:
    return final.with_name(OLD_PREFIX + _name_hash(final))


def _name_hash(final: Path) -> str:
    return hashlib.sha1(final.name.encode()).hexdigest()[:16]


def prepare_temporary(final: Path) -> Path:
    """Rank 0, before a save: an empty temporary directory next to ``final`` (a stale one is removed)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not (final.is_dir() and (is_committed(final) or not any(final.iterdir()))):
        # The commit replaces `final`; never delete something that is not a checkpoint.
        raise ValueError(
            f"cannot save a checkpoint to {str(final)!r}: it exists and is not a committed checkpoint (a file, or a "
            "directory without a COMMITTED marker). Choose another path or remove it."
        )
    tmp, old = temporary_path(final), _aside_path(final)
    if not final.exists() and is_committed(tmp):
        # The previous save of this name committed but died before its rename: finish it, keep it.
        os.replace(tmp, final)
    if tmp.exists():
        shutil.rmtree(tmp)
    if old.exists() and is_committed(final):
        shutil.rmtree(old)
    tmp.mkdir()
    return tmp


def commit(tmp: Path, final: Path, meta: CheckpointMeta) -> None:
    """Rank 0, after every rank finished writing into ``tmp``: meta.json, marker, rename to ``final``.

    An existing ``final`` is renamed aside first and deleted last, so at every moment one committed
    copy exists on disk.
    """
    _write_synced(tmp / META_FILE, meta.to_json())
    _write_synced(tmp / MARKER_FILE, json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "step": meta.step}))
    _fsync_directory(tmp)
    old = _aside_path(final)
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_directory(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    # A rename is durable only once its directory is synced; some filesystems refuse, which is harmless.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

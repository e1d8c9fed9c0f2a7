"""A checkpoint directory on disk: what it holds and its commit protocol. No collectives here.

A checkpoint is one directory::

    <data>/
        .metadata            DCP's index: every key's global shape and where its chunks are
        __<r>_<i>.distcp     DCP's data files, written by the ranks of sharding group 0
        host_state.pt        trainer state (torch.save by global rank 0)
        meta.json            human-readable description (CheckpointMeta)
        COMMITTED            commit marker, written last

and its name, ``<name>`` (e.g. ``last.ckpt``), is a symlink to it, so that replacing a checkpoint
is one atomic ``os.replace`` of a symlink: at every instant ``<name>`` is the old checkpoint or the
new one, never missing. All helper names start with a dot and hold a hash of ``<name>``, not
``<name>`` itself, so a search by name (Lightning's ``ckpt_path="last"`` looks for ``last*.ckpt``)
only ever finds ``<name>``. The commit protocol, by global rank 0 once every rank has written:

1. every rank writes into ``.partial-<h>`` (created empty by ``prepare_temporary``);
2. ``meta.json`` and then ``COMMITTED`` are written and fsynced: from here on the save counts;
3. ``.partial-<h>`` is renamed to a fresh ``.ckpt-<h>-<id>`` (the data directory);
4. a symlink ``.link-<h>`` -> ``.ckpt-<h>-<id>`` is made and ``os.replace``-d onto ``<name>``;
5. the previous data directory is deleted, its marker first (a half-deleted copy is never committed).

A crash anywhere leaves ``<name>`` pointing at the old copy (before 4) or the new one (after).
The recovery rule makes a resume never go backwards: ``resolve`` (used by every load, and by
``read_meta``) picks, among ``<name>`` and this name's committed helper directories (a save that
died between 2 and 4), the newest by step, then commit time; the next save first points
``<name>`` at that copy atomically, then deletes the rest. A ``<name>`` that is still a real
directory (written before this layout) is swapped for the symlink with Linux's atomic
``renameat2(RENAME_EXCHANGE)``; where that is unavailable it is renamed aside first, a gap in
which only ``resolve`` (not a search by name) finds the checkpoint. A directory without the marker
is never a checkpoint (``is_committed``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import sys
import uuid
from dataclasses import MISSING, asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from lightning_recsys.checkpoint.atomic_swap import exchange as _exchange

FORMAT = "lightning_recsys.dcp"
FORMAT_VERSION = 1
META_FILE = "meta.json"
MARKER_FILE = "COMMITTED"
HOST_STATE_FILE = "host_state.pt"
TMP_PREFIX = ".partial-"
DATA_PREFIX = ".ckpt-"
LINK_PREFIX = ".link-"
OLD_PREFIX = ".replaced-"  # the aside copy of this package's earlier commit protocol; still recovered

_VERSIONED_DISTRIBUTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch", ("torch",)),
    ("torchrec", ("torchrec",)),
    ("fbgemm_gpu", ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-nightly")),
    ("lightning_recsys", ("lightning-recsys",)),
)


class UncommittedCheckpointError(ValueError):
    """The directory is not a committed checkpoint (missing, partial, or from an interrupted save)."""


class CheckpointCorruptError(UncommittedCheckpointError):
    """A checkpoint file is missing, cut short, crafted or disagrees with the index; it was refused before anything was loaded."""


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
    def from_dict(cls, data: Any, *, source: Path) -> CheckpointMeta:
        # meta.json may have been edited by hand: every problem is an UncommittedCheckpointError naming it,
        # which latest_checkpoint() and resolve() skip, never a TypeError deep in a comparison.
        damaged = f"the checkpoint is damaged (was {source / META_FILE} edited by hand?)"
        if not isinstance(data, dict):
            raise UncommittedCheckpointError(f"{source / META_FILE} is not a JSON object (got {type(data).__name__}); {damaged}.")
        if data.get("format") != FORMAT:
            raise UncommittedCheckpointError(
                f"{source} has format={data.get('format')!r}, not {FORMAT!r}: it was not written by "
                "lightning_recsys.checkpoint."
            )
        version = data.get("format_version")
        if not _is_int(version):
            raise UncommittedCheckpointError(f"{source} has format_version={version!r}, not an integer; {damaged}.")
        if version > FORMAT_VERSION:
            raise UncommittedCheckpointError(
                f"{source} has format_version={version!r}; this lightning_recsys reads versions <= "
                f"{FORMAT_VERSION}. Upgrade lightning_recsys to load it."
            )
        fields = cls.__dataclass_fields__
        required = [n for n, f in fields.items() if f.default is MISSING and f.default_factory is MISSING]
        missing = [n for n in required if n not in data]
        if missing:
            raise UncommittedCheckpointError(f"{source / META_FILE} lacks {', '.join(map(repr, missing))}; {damaged}.")
        step = data.get("step")
        if step is not None and not _is_int(step):
            raise UncommittedCheckpointError(f"{source / META_FILE} has step={step!r}, not an integer or null; {damaged}.")
        for name in ("world_size", "sharding_group_size", "num_replicas"):
            if not _is_int(data[name]) or data[name] < 1:
                raise UncommittedCheckpointError(f"{source / META_FILE} has {name}={data[name]!r}, not an integer >= 1; {damaged}.")
        for name, kind in (("plan", list), ("tables", dict), ("embedding_optimizer", dict), ("versions", dict), ("extra", dict),
                           ("written_by_ranks", list), ("layout", str), ("saved_at", str)):
            if name in data and not isinstance(data[name], kind):
                raise CheckpointCorruptError(f"{source / META_FILE} has {name} of type {type(data[name]).__name__}, not {kind.__name__}; {damaged}.")
        return cls(**{k: v for k, v in data.items() if k in fields})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def checkpoint_path(path: Any, *, argument: str = "path", also: str = "") -> Path:
    """``path`` as a ``Path``; a ``TypeError`` naming ``argument`` for anything but a str or os.PathLike.

    ``also``: the other values the caller accepts, for the message (e.g. Lightning's ``'last'``).
    """
    if isinstance(path, (str, os.PathLike)):
        return Path(path)
    article = "an" if type(path).__name__[:1].lower() in "aeiou" else "a"
    raise TypeError(
        f"{argument}={path!r} is {article} {type(path).__name__}, not a checkpoint path: pass a str or os.PathLike naming "
        f"a checkpoint directory TwoDRecStrategy saved (e.g. 'lightning_logs/version_0/checkpoints/last.ckpt'){also}."
    )


def is_committed(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a directory holding a commit marker (written last by a finished save)."""
    return (Path(path) / MARKER_FILE).is_file()


def read_meta(path: str | os.PathLike[str]) -> CheckpointMeta:
    """The ``meta.json`` of the checkpoint ``path`` names (see ``resolve``); raises ``UncommittedCheckpointError`` otherwise."""
    return _read_meta_at(resolve(path))


def _read_meta_at(path: Path) -> CheckpointMeta:
    if path.is_file():
        raise UncommittedCheckpointError(
            f"checkpoint {str(path)!r} is a file, not a checkpoint directory: TwoDRecStrategy saves each checkpoint as a "
            "directory of DCP shards. A file like this one (e.g. a torch.save of Lightning's checkpoint dict, from "
            "another strategy) cannot be resumed with ckpt_path; load its 'state_dict' into the unsharded model (real, "
            "not meta, tables) before fit instead, or pass a checkpoint TwoDRecStrategy saved."
        )
    if not path.is_dir():
        raise UncommittedCheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a directory).")
    if not is_committed(path):
        _refuse_a_directory_that_holds_checkpoints(path)
        raise UncommittedCheckpointError(
            f"{str(path)!r} is not a committed checkpoint: it has no {MARKER_FILE} marker, so its save never "
            "finished (a crash or a save still in progress). Load an earlier checkpoint, e.g. "
            "latest_checkpoint(parent_directory), which skips uncommitted directories."
        )
    try:  # a regular file, never followed or waited on (a FIFO), bounded; deep nesting and huge numbers are damage too
        fd = os.open(path / META_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            data = json.loads(f.read(1 << 24))
    except (OSError, ValueError, RecursionError) as error:
        raise CheckpointCorruptError(f"{path / META_FILE} cannot be read ({type(error).__name__}: {str(error)[:200]}); "
                                     "the checkpoint is damaged and nothing was loaded.") from error
    return CheckpointMeta.from_dict(data, source=path)


def _refuse_a_directory_that_holds_checkpoints(path: Path) -> None:
    """A clear error for an empty directory, or one that holds checkpoints (a ModelCheckpoint dirpath), given as one."""
    children = sorted(c for c in path.iterdir() if not _is_helper(c.name))
    if not children and not any(path.iterdir()):
        raise UncommittedCheckpointError(
            f"{str(path)!r} is an empty directory, not a checkpoint (it has no {MARKER_FILE} marker). Pass a checkpoint "
            "directory TwoDRecStrategy saved, e.g. latest_checkpoint(parent_directory) ('.../checkpoints/last.ckpt')."
        )
    held = [c.name for c in children if is_committed(c)]
    if held:
        shown = held if len(held) <= 6 else [*held[:6], "..."]
        newest = latest_checkpoint(path)
        raise UncommittedCheckpointError(
            f"{str(path)!r} is a directory of checkpoints, not one: it holds {shown}. Pass one of them, e.g. the newest, "
            f"{str(newest)!r} (latest_checkpoint({str(path)!r}) finds it)."
        )


_OrderKey = tuple[int, int, str, float]


def _order_key(path: Path) -> _OrderKey | None:
    """How new the committed checkpoint at ``path`` is: step, then commit time; None if it is not one."""
    if not is_committed(path):
        return None
    try:
        meta = _read_meta_at(path)
        mtime = (path / MARKER_FILE).stat().st_mtime
    except (UncommittedCheckpointError, OSError):
        return None  # a damaged meta.json: not a checkpoint we can order or load
    return (int(meta.step is not None), meta.step or 0, meta.saved_at, mtime)


def resolve(path: str | os.PathLike[str]) -> Path:
    """The directory a load of ``path`` reads: ``path``, or a newer committed copy of the same name.

    A save that died after its commit marker but before its symlink swap leaves a complete copy
    under a helper name; it is newer than ``path``'s, and a resume must not go back behind it.
    Ties go to ``path`` itself. Paths that are helper directories are returned as they are.
    """
    path = checkpoint_path(path)
    if _is_helper(path.name):
        return path
    best, best_key = path, _order_key(path)
    for copy in _own_copies(path):
        key = _order_key(copy)
        if key is None or (best_key is not None and key <= best_key) or _same_directory(copy, path):
            continue
        if not _superseded(copy, path):
            best, best_key = copy, key
    return best


def _superseded(copy: Path, name: Path) -> bool:
    """True if ``copy``, a helper directory of ``name``, was committed before ``name`` was pointed elsewhere.

    ``ModelCheckpoint(save_last="link")`` replaces ``last.ckpt`` with its own symlink to another
    checkpoint (``os.remove`` then ``os.symlink``), leaving the data directory the name pointed to
    behind: that copy is what the name held before, not a save of it that died before its swap (such
    a save commits after the name was last pointed). Resolving to it would load an older run's
    checkpoint in place of the linked one whenever the old copy has the higher step.
    """
    if not name.is_symlink() or _own_target(name) is not None:
        return False  # the name is ours (or missing): a newer helper copy is an interrupted save
    try:
        return (copy / MARKER_FILE).stat().st_mtime_ns <= name.lstat().st_mtime_ns
    except OSError:
        return False


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint directly inside ``directory``, or None if there is none.

    Directories without the commit marker (partial saves) are skipped. Order: the ``step`` in
    ``meta.json`` (a checkpoint without a step sorts before any with one), then ``saved_at``, then
    the marker's mtime, then the name. A checkpoint is returned by its name (``last.ckpt``), not
    the helper directory the name points to; a committed copy that no name points to yet (a save
    that died before its symlink swap) is returned by its helper name if it is the newest.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    by_directory: dict[str, tuple[tuple[int, int, str, float, int, str], Path]] = {}
    children = list(directory.iterdir())
    names = {_name_hash(c): c for c in children if not _is_helper(c.name)}
    for child in children:
        if not child.is_dir():
            continue
        name = names.get(_helper_hash(child.name) or "")
        if name is not None and _superseded(child, name):
            continue  # what a name held before it was linked elsewhere (see _superseded)
        key = _order_key(child)
        if key is None:
            continue
        ranked = (*key, int(not _is_helper(child.name)), child.name)  # names before helpers
        real = os.path.realpath(child)
        if real not in by_directory or ranked > by_directory[real][0]:
            by_directory[real] = (ranked, child)
    return max(by_directory.values())[1] if by_directory else None


# ----------------------------------------------------------------- rank-0 file operations
def temporary_path(final: Path) -> Path:
    """Where the ranks write a save of ``final`` before it is committed."""
    return final.with_name(TMP_PREFIX + _name_hash(final))


def _link_path(final: Path) -> Path:
    return final.with_name(LINK_PREFIX + _name_hash(final))


def _fresh_data_path(final: Path) -> Path:
    return final.with_name(f"{DATA_PREFIX}{_name_hash(final)}-{uuid.uuid4().hex[:12]}")


def _name_hash(final: Path) -> str:
    return hashlib.sha1(final.name.encode()).hexdigest()[:16]


def _helper_hash(name: str) -> str | None:
    """The name hash in a helper entry's name (``.ckpt-<h>-<id>``, ``.partial-<h>``, ...), None for other names."""
    for prefix in (TMP_PREFIX, DATA_PREFIX, LINK_PREFIX, OLD_PREFIX):
        if name.startswith(prefix):
            return name[len(prefix) :].split("-", 1)[0]
    return None


def _is_helper(name: str) -> bool:
    return name.startswith((TMP_PREFIX, DATA_PREFIX, LINK_PREFIX, OLD_PREFIX))


def _own_helpers(final: Path) -> list[Path]:
    """Every helper entry of ``final``'s name: partial save, data directories, link, old protocol's aside."""
    h = _name_hash(final)
    names = {TMP_PREFIX + h, LINK_PREFIX + h, OLD_PREFIX + h}
    if not final.parent.is_dir():
        return []
    return sorted(c for c in final.parent.iterdir() if c.name in names or c.name.startswith(f"{DATA_PREFIX}{h}-"))


def _own_copies(final: Path) -> list[Path]:
    """The helper directories of ``final`` that may hold a checkpoint (not symlinks)."""
    return [c for c in _own_helpers(final) if c.is_dir() and not c.is_symlink()]


def _same_directory(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _own_target(final: Path) -> Path | None:
    """The data directory ``final`` points to, if ``final`` is a symlink to one of its own."""
    if not final.is_symlink():
        return None
    target = final.parent / os.readlink(final)
    return target if target.parent == final.parent and target in _own_copies(final) else None


def prepare_temporary(final: Path) -> Path:
    """Rank 0, before a save: recover ``final`` (see ``resolve``), clear its helpers, make an empty temporary directory."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.is_symlink() and not final.exists():
        pass  # a dangling symlink (its checkpoint was deleted): nothing to protect
    elif final.exists() and not (final.is_dir() and (is_committed(final) or not any(final.iterdir()))):
        # The commit replaces `final`; never delete something that is not a checkpoint.
        raise ValueError(
            f"cannot save a checkpoint to {str(final)!r}: it exists and is not a committed checkpoint (a file, or a "
            "directory without a COMMITTED marker). Choose another path or remove it."
        )
    newest = resolve(final)
    if newest != final:
        # An earlier save of this name committed but died before its swap: finish it first, so that
        # a crash of this save leaves the newest copy under the name.
        if newest.name in (temporary_path(final).name, OLD_PREFIX + _name_hash(final)):
            fresh = _fresh_data_path(final)
            os.rename(newest, fresh)
            newest = fresh
        for leftover in _publish(final, newest):
            _discard(leftover)
    keep = _own_target(final)
    for helper in _own_helpers(final):
        if keep is None or helper != keep:
            _discard(helper)
    tmp = temporary_path(final)
    tmp.mkdir()
    return tmp


def commit(tmp: Path, final: Path, meta: CheckpointMeta) -> None:
    """Rank 0, after every rank finished writing into ``tmp``: marker, then one atomic swap of ``final``.

    The steps are in the module docstring; at every moment ``final`` names a committed copy,
    the old or the new one (once ``final`` exists at all).
    """
    _write_synced(tmp / META_FILE, meta.to_json())
    _write_synced(tmp / MARKER_FILE, json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "step": meta.step}))
    _fsync_directory(tmp)
    data = _fresh_data_path(final)
    os.rename(tmp, data)
    _fsync_directory(final.parent)  # the data directory's name is durable before anything points at it
    for leftover in _publish(final, data):
        _discard(leftover)


def _publish(final: Path, data: Path) -> list[Path]:
    """Point ``final`` at ``data`` atomically; returns what ``final`` named before, to delete afterwards."""
    previous = _own_target(final)
    link = _link_path(final)
    if link.exists() or link.is_symlink():
        _discard(link)
    os.symlink(data.name, link)  # relative: the directory can be moved or mounted elsewhere
    if final.is_dir() and not final.is_symlink():
        # A real directory (the layout before symlinks, or an empty one): a symlink cannot replace it.
        if _exchange(link, final):
            _fsync_directory(final.parent)
            return [link]  # `link` now names the old directory
        aside = _fresh_data_path(final)
        os.rename(final, aside)  # no atomic swap on this platform: until the next line only resolve() finds it
        os.replace(link, final)
        _fsync_directory(final.parent)
        return [aside]
    os.replace(link, final)
    _fsync_directory(final.parent)
    return [previous] if previous is not None and previous != data else []


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete the checkpoint ``path`` names: the name, the data it points to, and its helper directories."""
    path = Path(path)
    helpers = _own_helpers(path)
    if path.is_symlink() or path.exists():
        _discard(path)
    for helper in helpers:
        _discard(helper)


def _discard(path: Path) -> None:
    """Delete a symlink, file or directory; a directory loses its commit marker first."""
    if path.is_symlink() or path.is_file():
        os.unlink(path)
    elif path.is_dir():
        if (path / MARKER_FILE).is_file():
            os.unlink(path / MARKER_FILE)  # a half-deleted copy must never look committed
        shutil.rmtree(path)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text), f.flush(), os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    # A rename is durable only once its directory is synced; some filesystems refuse, which is harmless.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # e.g. a filesystem that cannot sync directories
    finally:
        os.close(fd)

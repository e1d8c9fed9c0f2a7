"""Opening a checkpoint's files as hostile input: regular files inside the data directory, never followed, never waited on.

A checkpoint's name is a symlink to its data directory (see ``directory``); that one link is ours and is
resolved once (``data_root``). Every file inside is then opened by its plain name with ``O_NOFOLLOW``
(a symlink planted in place of a shard or ``host_state.pt`` is refused, not followed to another
checkpoint or to ``/etc/passwd``) and ``O_NONBLOCK`` (a FIFO in place of ``.metadata`` is refused at
once instead of blocking the load forever), and must be a regular file by ``fstat`` of the open
descriptor, so what is checked is what is read.
"""

from __future__ import annotations

import errno
import os
import pickle
import stat
from pathlib import Path

from lightning_recsys.checkpoint.directory import CheckpointCorruptError


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds a pickled global that loading it would import or call; nothing was loaded."""


def corrupt(path: Path | str, problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{path}: {problem}; the checkpoint is damaged (a truncated, overwritten or deleted file) and nothing was "
        "loaded. Load another checkpoint, e.g. an earlier one of the same run."
    )


def data_root(directory: Path | str) -> Path:
    """The real data directory a checkpoint path names (its symlink resolved once); refuses anything but a directory."""
    real = Path(os.path.realpath(directory))
    try:
        mode = os.stat(real).st_mode
    except OSError as error:
        raise corrupt(directory, f"the checkpoint directory cannot be opened ({error.strerror})") from error
    if not stat.S_ISDIR(mode):
        raise corrupt(directory, "the checkpoint is not a directory")
    return real


def check_plain_name(name: object, *, where: Path | str, field: str) -> str:
    """``name`` must be one file name (no separator, not '.' or '..', no NUL): the index and records name files by it."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name or name != os.path.basename(name):
        raise corrupt(where, f"{field} names the file {name!r}, which is not a file name inside the checkpoint")
    return name


def open_regular(root: Path, name: str, *, what: str, missing: str | None = None) -> int:
    """A read-only descriptor of the regular file ``root/name``; ``CheckpointCorruptError`` for anything else.

    ``root`` must come from ``data_root``. ``what`` says what the file is, for the message; ``missing`` is
    the message for a file that does not exist (default: "<what> is missing").
    """
    path = root / check_plain_name(name, where=root, field=what)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as error:
        raise corrupt(path, missing or f"{what} is missing") from error
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise corrupt(path, f"{what} is a symbolic link; a checkpoint's files are regular files, never links") from error
        raise corrupt(path, f"{what} cannot be opened ({error.strerror})") from error
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
            raise corrupt(path, f"{what} is {kind}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_size(fd: int) -> int:
    return os.fstat(fd).st_size


def read_at(fd: int, offset: int, length: int, *, path: Path | str, what: str) -> bytes:
    """Exactly ``length`` bytes at ``offset`` (``pread``, so no shared file position); a short read is damage."""
    chunks: list[bytes] = []
    done = 0
    while done < length:
        chunk = os.pread(fd, min(length - done, 1 << 24), offset + done)
        if not chunk:
            raise corrupt(path, f"{what}: the file ended at byte {offset + done}, before byte {offset + length}")
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def read_whole(root: Path, name: str, *, what: str, limit: int, missing: str | None = None) -> bytes:
    """The bytes of the regular file ``root/name``, refusing one larger than ``limit`` bytes before reading it."""
    fd = open_regular(root, name, what=what, missing=missing)
    try:
        size = file_size(fd)
        if size > limit:
            raise corrupt(root / name, f"{what} has {size} bytes, more than the {limit} this reader accepts")
        return read_at(fd, 0, size, path=root / name, what=what)
    finally:
        os.close(fd)

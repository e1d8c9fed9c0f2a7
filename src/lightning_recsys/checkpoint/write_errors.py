"""A save that fails for lack of disk space says so, naming the path, instead of DCP's per-rank exception dump."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointDiskFullError(OSError):
    """A checkpoint save ran out of disk space (ENOSPC) or quota (EDQUOT)."""


def explain_write_error(error: BaseException, *, final: Path, tmp: Path) -> BaseException:
    """``error`` itself, or a ``CheckpointDiskFullError`` naming ``final``'s filesystem if disk space ran out."""
    full = _disk_full_cause(error) or _zip_writer_out_of_space(error, tmp)
    if full is None:
        return error
    free = _megabytes(shutil.disk_usage(tmp.parent).free) if tmp.parent.exists() else "?"
    previous = os.path.realpath(final)
    kept = (
        f"The previous checkpoint {str(final)!r} ({_megabytes(_size(Path(previous)))} MB) is untouched and still loads; "
        if os.path.isdir(previous)
        else ""
    )
    message = (
        f"saving checkpoint {str(final)!r} failed: no space left on the device of {str(final.parent)!r} "
        f"({os.strerror(full.errno)}, writing {full.filename or tmp}; {free} MB free). {kept}the partial save in "
        f"{str(tmp)!r} is not a checkpoint and is removed by the next save of this name. A save needs room for a second "
        "copy until it commits: free disk space, or save to a larger filesystem (ModelCheckpoint(dirpath=...))."
    )
    return CheckpointDiskFullError(full.errno, message)


def _disk_full_cause(error: BaseException | None, depth: int = 0) -> OSError | None:
    if error is None or depth > 8:
        return None
    if isinstance(error, OSError) and error.errno in _DISK_FULL:
        return error
    if isinstance(error, CheckpointException):  # DCP keeps each failed rank's exception (or (exception, traceback))
        for failure in error.failures.values():
            found = _disk_full_cause(failure[0] if isinstance(failure, tuple) else failure, depth + 1)
            if found is not None:
                return found
    return _disk_full_cause(error.__cause__ or error.__context__, depth + 1)


def _zip_writer_out_of_space(error: BaseException, tmp: Path) -> OSError | None:
    """torch.save's zip writer (PytorchStreamWriter, caffe2/serialize/inline_container.cc) reports a short write
    as a RuntimeError without errno; count it as disk full when the filesystem has less than 1 MiB left."""
    failures = error.failures.values() if isinstance(error, CheckpointException) else [error]
    messages = [str(f[0] if isinstance(f, tuple) else f) for f in failures]
    if not any("inline_container" in m for m in messages) or not tmp.parent.exists():
        return None
    if shutil.disk_usage(tmp.parent).free >= 2**20:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _megabytes(size: int) -> str:
    return f"{size / 2**20:.1f}"

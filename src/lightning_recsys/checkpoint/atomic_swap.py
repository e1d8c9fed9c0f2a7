"""Linux's atomic swap of two paths, ``renameat2(RENAME_EXCHANGE)``, for replacing a real checkpoint directory."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False  # glibc older than 2.28
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):  # the filesystem cannot swap
        return False
    raise OSError(error, os.strerror(error), str(a), None, str(b))

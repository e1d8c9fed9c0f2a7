"""Removing a checkpoint only where it is ours: inside its folder, committed, in this package's layout.

Lightning asks the checkpoint IO to remove paths it keeps in ``ModelCheckpoint``'s state (the previous
best, the k-th best, the last), and that state is restored from a checkpoint's ``host_state.pt``: a crafted
checkpoint can name ``../../anything``. ``removal_refusal`` says why a path must not be removed, and
``remove_checkpoint`` skips such a path with one warning naming it instead of deleting it.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from collections.abc import Iterable
from pathlib import Path

from lightning_recsys.checkpoint.directory import FORMAT, MARKER_FILE, META_FILE, _discard, _is_helper, _own_helpers, _own_target


class CheckpointRemovalSkipped(UserWarning):
    """A path given to remove is not a checkpoint of this package inside its folder; it was left alone."""


def _committed_layout(data: Path) -> str | None:
    """Why the real directory ``data`` is not a committed checkpoint of this package (None if it is)."""
    try:
        if stat.S_ISLNK(os.lstat(data).st_mode) or not stat.S_ISDIR(os.lstat(data).st_mode):
            return "it is not a directory"
        if not stat.S_ISREG(os.lstat(data / MARKER_FILE).st_mode) or not stat.S_ISREG(os.lstat(data / META_FILE).st_mode):
            return f"it has no {MARKER_FILE} marker and {META_FILE} as regular files"
        with open(data / META_FILE, "rb") as f:
            meta = json.loads(f.read(1 << 20))
    except (OSError, ValueError, RecursionError):
        return f"it has no readable {MARKER_FILE} and {META_FILE}"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"its {META_FILE} is not this package's format"
    return None


def removal_refusal(path: str | os.PathLike[str], folders: Iterable[str | os.PathLike[str]] | None = None) -> str | None:
    """Why ``path`` must not be removed, or None. ``folders``: the checkpoint folders it must lie in (if known)."""
    raw = os.fspath(path)
    if not raw or ".." in Path(raw).parts:
        return "it climbs out of its folder with '..'"
    name = Path(os.path.abspath(raw))
    if _is_helper(name.name):
        return "it is a helper directory, not a checkpoint's name"
    if folders is not None:
        allowed = {os.path.realpath(f) for f in folders}
        if os.path.realpath(name.parent) not in allowed:
            return f"it is not inside the checkpoint folder ({', '.join(sorted(allowed)) or 'none configured'})"
    try:
        mode = os.lstat(name).st_mode
    except FileNotFoundError:
        return None  # nothing under the name; its helpers (if any) are still removed
    except OSError as error:
        return f"it cannot be inspected ({error.strerror})"
    if stat.S_ISLNK(mode):
        target = _own_target(name)
        if target is not None:
            return _committed_layout(target) and f"the directory it points to is not a checkpoint: {_committed_layout(target)}"
        link = os.readlink(name)
        # ModelCheckpoint(save_last="link"): a link to another name in the same folder; removing it unlinks the link only.
        if os.path.isabs(link) or os.sep in link or link in (".", ".."):
            return f"it is a symlink to {link!r}, not to a checkpoint of this folder"
        return None
    if stat.S_ISDIR(mode):
        problem = _committed_layout(name)
        return problem and f"it is not a committed checkpoint of this package: {problem}"
    return "it is a file, not a checkpoint directory"


def remove_checkpoint(path: str | os.PathLike[str], *, folders: Iterable[str | os.PathLike[str]] | None = None) -> bool:
    """Delete the checkpoint ``path`` names (the name, its data, its helpers); skip with a warning if not ours.

    Returns whether it was removed. Never follows a symlink out of the folder: the name's own link is
    unlinked, and only a data directory of this name's hash, in the same folder, is deleted.
    """
    folder_list = None if folders is None else list(folders)
    problem = removal_refusal(path, folder_list)
    if problem:
        warnings.warn(f"not removing {os.fspath(path)!r}: {problem}. Only checkpoints this package saved there are removed.", CheckpointRemovalSkipped, stacklevel=2)
        return False
    name = Path(os.path.abspath(os.fspath(path)))
    helpers = _own_helpers(name)  # before the name goes: they are found by its hash
    if os.path.lexists(name):
        _discard(name)
    for helper in helpers:
        _discard(helper)
    return True

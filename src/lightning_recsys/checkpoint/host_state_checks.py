"""What ``host_state.pt`` tells a loader to do, checked before it is done.

``host_state.pt`` passes ``weights_only=True`` as plain data, but plain data can still direct the load:

- the table-reshape record makes ``load_unsharded`` rebuild tables of the sizes it names (a memory bomb
  of the author's choosing) and replace submodules before the shards are read;
- ``ModelCheckpoint``'s restored state names the paths Lightning later asks the checkpoint IO to delete.

``check_reshape_record`` refuses a record that is not what ``reshape_record`` writes, or that grows a
table; ``ModuleTreeSnapshot`` puts the module tree back if a load is refused after the reshape;
``drop_foreign_checkpoint_paths`` removes callback paths outside the callback's own folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from lightning_recsys.checkpoint.safe_files import corrupt
from lightning_recsys.parallel.sharding import RESHAPE_CHECKPOINT_KEY

_RECORD_FIELDS = {"table": str, "rows": int, "dim": int, "new_rows": int, "new_dim": int, "id_mapping": str, "restore_dim": bool}
_REQUIRED = {"table", "rows", "dim", "new_rows", "new_dim"}
_MAX_TABLES = 100_000


def check_reshape_record(record: Any, where: Path) -> list[dict[str, Any]] | None:
    """The recorded reshape, refused unless each entry is a table moved to the same number of elements."""
    if record is None:
        return None
    field = "the table-reshape record (lightning_recsys_reshaped_tables)"
    if type(record) is not list or len(record) > _MAX_TABLES:
        raise corrupt(where, f"{field} is a {type(record).__name__}, not a list of tables")
    for i, entry in enumerate(record):
        if type(entry) is not dict or not _REQUIRED <= set(entry) or not set(entry) <= set(_RECORD_FIELDS):
            raise corrupt(where, f"{field}[{i}] does not have the fields {sorted(_RECORD_FIELDS)}")
        for key, value in entry.items():
            if type(value) is not _RECORD_FIELDS[key]:
                raise corrupt(where, f"{field}[{i}].{key} is {str(value)[:60]!r}, not a {_RECORD_FIELDS[key].__name__}")
        if min(entry["rows"], entry["dim"], entry["new_rows"], entry["new_dim"]) < 1:
            raise corrupt(where, f"{field}[{i}] has a size below 1")
        if entry["new_rows"] * entry["new_dim"] != entry["rows"] * entry["dim"]:
            raise corrupt(where, f"{field}[{i}] reshapes {entry['rows']} x {entry['dim']} to {entry['new_rows']} x {entry['new_dim']}, another number of elements")
        if entry.get("id_mapping", "interleave") not in ("interleave", "identity"):
            raise corrupt(where, f"{field}[{i}].id_mapping is {entry['id_mapping'][:40]!r}")
    return record


class ModuleTreeSnapshot:
    """Every submodule of ``root`` by parent and attribute, to undo a reshape if the load is then refused."""

    def __init__(self, root: nn.Module) -> None:
        self.links = [(parent, name, child) for parent in root.modules() for name, child in parent._modules.items()]

    def restore(self) -> None:
        for parent, name, child in self.links:
            if parent._modules.get(name) is not child:
                parent._modules[name] = child


_PATH_KEYS = ("best_model_path", "kth_best_model_path", "last_model_path")


def drop_foreign_checkpoint_paths(host_state: dict[str, Any]) -> list[str]:
    """Blank out callback-state paths that do not lie directly in that state's own ``dirpath``; returns what was dropped.

    Lightning's ``ModelCheckpoint.load_state_dict`` restores these paths when the saved ``dirpath`` is
    absent or equals its own, and later removes the "previous best" by path: a crafted state could name any
    directory. Paths of an honest save are ``os.path.join(dirpath, name)``.
    """
    dropped: list[str] = []
    callbacks = host_state.get("callbacks")
    if not isinstance(callbacks, dict):
        return dropped
    for owner, state in callbacks.items():
        if not isinstance(state, dict) or not any(k in state for k in (*_PATH_KEYS, "best_k_models")):
            continue
        dirpath = state.get("dirpath")
        folder = os.path.normpath(dirpath) if isinstance(dirpath, str) and dirpath else None

        def inside(path: Any) -> bool:
            if not isinstance(path, str) or folder is None or ".." in Path(path).parts:
                return False
            return os.path.dirname(os.path.normpath(path)) == folder and os.path.basename(path) not in ("", ".", "..")

        best = state.get("best_k_models", {})
        foreign = [f"{owner}.{k}={str(state[k])[:200]!r}" for k in _PATH_KEYS if state.get(k) and not inside(state[k])]
        if not isinstance(best, dict):
            foreign.append(f"{owner}.best_k_models")
        else:
            foreign += [f"{owner}.best_k_models[{str(p)[:200]!r}]" for p in best if not inside(p)]
        if foreign:
            # All or nothing: Lightning pops kth_best_model_path from best_k_models, so a half-cleaned state raises there.
            state.update({k: "" for k in _PATH_KEYS}, best_k_models={})
            dropped += foreign
    return dropped

"""Old import paths of ``data/`` (before it was grouped by source) fail with an error that names the new path."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

# Modules that moved when data/ was grouped by source, old -> new.
MOVED_MODULES: dict[str, str] = {
    "lightning_recsys.data.criteo_arrow": "lightning_recsys.data.criteo.arrow",
    "lightning_recsys.data.criteo_binary": "lightning_recsys.data.criteo.binary",
    "lightning_recsys.data.criteo_format": "lightning_recsys.data.criteo.format",
    "lightning_recsys.data.criteo_parse": "lightning_recsys.data.criteo.parse",
    "lightning_recsys.data.criteo_ranges": "lightning_recsys.data.criteo.ranges",
    "lightning_recsys.data.criteo_to_npy": "lightning_recsys.data.criteo.to_npy",
    "lightning_recsys.data.movielens_sequence": "lightning_recsys.data.movielens.histories",
    "lightning_recsys.data.synthetic_sequence": "lightning_recsys.data.synthetic.sequence_log",
    "lightning_recsys.data.sequences.movielens": "lightning_recsys.data.movielens.pretrain",
    "lightning_recsys.data.sequences.synthetic": "lightning_recsys.data.synthetic.planted_chains",
}


def moved_name_error(module: str, name: str, moved: dict[str, str]) -> Exception:
    """The error for ``module.name``: an ``ImportError`` naming where it lives now, if it moved (``from module import
    name`` replaces an ``AttributeError``'s message with its own)."""
    if name in moved:
        return ImportError(f"{module}.{name} moved to {moved[name]}.{name}; import it from there (or from lightning_recsys.data).")
    return AttributeError(f"module {module!r} has no attribute {name!r}")


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Refuses an old module path with ``ModuleNotFoundError`` naming its new one (instead of a bare "no module")."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED_MODULES:
            new = MOVED_MODULES[fullname]
            raise ModuleNotFoundError(f"{fullname} moved to {new}; import it from there (or its names from lightning_recsys.data).", name=fullname)
        return None


def install_moved_module_finder() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())  # last: only asked when no real module has the name

"""Run code around a module's first import: a ``sys.meta_path`` finder that wraps the found loader's ``exec_module``.

Python has no public post-import hook (PEP 369 was withdrawn); this is the approach of
``wrapt.register_post_import_hook``. Used to register ``"twod_rec"`` once Lightning's strategy registry exists
(``_registration``) and to undo the root-logger handler FBGEMM's import installs (``_upstream_logging``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ExecModule = Callable[[ModuleType], None]
_LOCK = threading.Lock()


def wrap_first_import(fullname: str, wrap: Callable[[ExecModule], ExecModule]) -> None:
    """Run ``fullname``'s first import through ``wrap(exec_module)``; once per name, and never if it is imported already."""
    with _LOCK:
        if fullname in sys.modules or any(isinstance(f, _WrapFirstImport) and f.fullname == fullname for f in sys.meta_path):
            return
        sys.meta_path.insert(0, _WrapFirstImport(fullname, wrap))


class _WrapFirstImport(importlib.abc.MetaPathFinder):
    """Finds ``fullname`` as the other finders would, and wraps its loader's ``exec_module`` once."""

    def __init__(self, fullname: str, wrap: Callable[[ExecModule], ExecModule]) -> None:
        self.fullname = fullname
        self.wrap = wrap

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.fullname:
            return None
        with _LOCK:
            if self in sys.meta_path:
                sys.meta_path.remove(self)  # one use; also keeps the search below from finding this finder
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        for finder in sys.meta_path if spec is None else ():
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec  # not a loader this hook knows how to wrap: leave the import alone
        loader.exec_module = self.wrap(exec_module)  # type: ignore[union-attr]  # this spec's own loader instance
        return spec

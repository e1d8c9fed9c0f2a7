"""Registers ``"twod_rec"`` in Lightning's ``StrategyRegistry`` without importing Lightning.

``import lightning_recsys`` calls ``register_strategy_name()``. Lightning's registry exists only
once ``lightning.pytorch.strategies`` has been imported, and the Trainer-free layers
(``lightning_recsys.parallel``, ``.planner``, ``.checkpoint``) must not import it, so:

* if that module is already imported, the name is registered at once;
* otherwise a hook on the import system registers it right after that module first runs, so
  ``import lightning_recsys`` before ``from lightning.pytorch import Trainer`` works too.

The registry entry is a factory, given by the caller, that imports ``TwoDRecStrategy`` when the
Trainer asks for it, so registering never imports the strategy (or Lightning) itself, and this
module imports nothing of the package (the strategy imports it for the name). Python has no public
post-import hook (PEP 369 was withdrawn); the hook below is a ``sys.meta_path`` finder that
wraps the found loader's ``exec_module``, as ``wrapt.register_post_import_hook`` does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Callable

STRATEGY_NAME = "twod_rec"
DESCRIPTION = "TorchRec-sharded embeddings with data-parallel dense layers (lightning-recsys)"
_REGISTRY_MODULE = "lightning.pytorch.strategies"
_LOCK = threading.Lock()

StrategyFactory = Callable[..., Any]  # keyword arguments -> a TwoDRecStrategy


def register(registry: Any, factory: StrategyFactory) -> None:
    """Add ``"twod_rec"`` (made by ``factory``) to a Lightning ``StrategyRegistry`` unless it is there already."""
    if STRATEGY_NAME not in registry:
        registry.register(STRATEGY_NAME, factory, description=DESCRIPTION)


def register_strategy_name(factory: StrategyFactory) -> None:
    """Register ``"twod_rec"`` now if Lightning's registry exists, else as soon as it is created."""
    with _LOCK:
        module = sys.modules.get(_REGISTRY_MODULE)
        registry = getattr(module, "StrategyRegistry", None) if module is not None else None
        if registry is not None:
            register(registry, factory)
        elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _RegisterAfterImport(factory))


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch.strategies`` as the other finders would, and registers once it has run."""

    def __init__(self, factory: StrategyFactory) -> None:
        self._factory = factory

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != _REGISTRY_MODULE:
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

        def exec_and_register(module: ModuleType) -> None:
            exec_module(module)
            try:
                register(module.StrategyRegistry, self._factory)
            except Exception as err:  # never break `import lightning` over our name
                warnings.warn(f"lightning_recsys could not register {STRATEGY_NAME!r}: {err}", stacklevel=2)

        loader.exec_module = exec_and_register  # type: ignore[union-attr]  # this spec's own loader instance
        return spec

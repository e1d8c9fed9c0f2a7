"""Registers ``"twod_rec"`` in Lightning's ``StrategyRegistry`` without importing Lightning.

``import lightning_recsys`` calls ``register_strategy_name(factory)``. Lightning's registry exists only
once ``lightning.pytorch.strategies`` has been imported, and the Trainer-free layers
(``lightning_recsys.parallel``, ``.planner``, ``.checkpoint``) must not import it, so:

* if that module is already imported, the name is registered at once;
* otherwise a hook on the import system registers it right after that module first runs, so
  ``import lightning_recsys`` before ``from lightning.pytorch import Trainer`` works too.

The registry entry is a factory, given by the caller, that imports ``TwoDRecStrategy`` when the
Trainer asks for it, so registering never imports the strategy (or Lightning) itself, and this
module imports nothing of the package above it (the strategy imports it for the name). The hook is
``_import_hooks.wrap_first_import``.
"""

from __future__ import annotations

import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Callable

from lightning_recsys._import_hooks import ExecModule, wrap_first_import

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
        else:
            wrap_first_import(_REGISTRY_MODULE, lambda exec_module: _register_after(exec_module, factory))


def _register_after(exec_module: ExecModule, factory: StrategyFactory) -> ExecModule:
    def exec_and_register(module: ModuleType) -> None:
        exec_module(module)
        try:
            register(module.StrategyRegistry, factory)
        except Exception as err:  # never break `import lightning` over our name
            warnings.warn(f"lightning_recsys could not register {STRATEGY_NAME!r}: {err}", stacklevel=2)

    return exec_and_register

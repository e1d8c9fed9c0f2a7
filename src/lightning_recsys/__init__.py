"""lightning-recsys: a PyTorch Lightning strategy for embedding-heavy recommendation models.

The names below are imported on first use, so ``import lightning_recsys.parallel`` (``.planner``,
``.checkpoint``) does not import Lightning. Importing the package registers ``"twod_rec"`` for
``Trainer(strategy="twod_rec")``, whether Lightning is imported before or after it (see
``lightning_recsys._registration``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_recsys._lazy import lazy_exports
from lightning_recsys._registration import register_strategy_name
from lightning_recsys._upstream_logging import keep_upstream_import_from_configuring_logging

__version__ = "0.1.0"

_EXPORTS = {
    "CommunicationMonitor": "lightning_recsys.callbacks",
    "DCPCheckpointIO": "lightning_recsys.strategies",
    "EmbeddingOptimizerConfig": "lightning_recsys.parallel",
    "GuardConfig": "lightning_recsys.parallel.input",
    "PlanningConfig": "lightning_recsys.planner.config",
    "QCommsConfig": "lightning_recsys.parallel.comms",
    "ReplicaSyncConfig": "lightning_recsys.parallel.sync",
    "TableConstraints": "lightning_recsys.planner",
    "TwoDRecStrategy": "lightning_recsys.strategies",
}

if TYPE_CHECKING:
    from lightning_recsys.callbacks import CommunicationMonitor
    from lightning_recsys.parallel import EmbeddingOptimizerConfig
    from lightning_recsys.parallel.comms import QCommsConfig
    from lightning_recsys.parallel.input import GuardConfig
    from lightning_recsys.parallel.sync import ReplicaSyncConfig
    from lightning_recsys.planner import TableConstraints
    from lightning_recsys.planner.config import PlanningConfig
    from lightning_recsys.strategies import DCPCheckpointIO, TwoDRecStrategy


def _make_twod_rec_strategy(**kwargs: Any) -> Any:
    """``TwoDRecStrategy(**kwargs)``, imported when the Trainer first asks for ``"twod_rec"`` (the registry's factory)."""
    return __getattr__("TwoDRecStrategy")(**kwargs)


register_strategy_name(_make_twod_rec_strategy)
keep_upstream_import_from_configuring_logging()  # FBGEMM's import would add a root handler: Lightning's lines twice


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "CommunicationMonitor",
    "DCPCheckpointIO",
    "EmbeddingOptimizerConfig",
    "GuardConfig",
    "PlanningConfig",
    "QCommsConfig", 
    "ReplicaSyncConfig",
    "TableConstraints",
    "TwoDRecStrategy",
    "__version__",
]

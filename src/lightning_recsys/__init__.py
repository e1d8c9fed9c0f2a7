"""lightning-recsys: a PyTorch Lightning strategy for embedding-heavy recommendation models."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_recsys.callbacks import CommunicationMonitor
from lightning_recsys.parallel import EmbeddingOptimizerConfig
from lightning_recsys.parallel.qcomms import QCommsConfig
from lightning_recsys.parallel.replica_sync_config import ReplicaSyncConfig
from lightning_recsys.planner import TableConstraints
from lightning_recsys.strategies import DCPCheckpointIO, TwoDRecStrategy

__version__ = "0.1.0"

if TwoDRecStrategy.strategy_name not in StrategyRegistry:
    TwoDRecStrategy.register_strategies(StrategyRegistry)

__all__ = ["CommunicationMonitor", "DCPCheckpointIO", "EmbeddingOptimizerConfig", "QCommsConfig", "ReplicaSyncConfig", "TableConstraints", "TwoDRecStrategy", "__version__"]

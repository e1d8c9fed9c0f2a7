"""Lightning strategies: map Trainer hooks onto lightning_recsys.parallel / planner / checkpoint."""

from lightning_recsys.strategies.checkpoint_io import DCPCheckpointIO
from lightning_recsys.strategies.twod_rec import TwoDRecStrategy

__all__ = ["DCPCheckpointIO", "TwoDRecStrategy"]

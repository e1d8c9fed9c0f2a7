"""Lightning strategies: map Trainer hooks onto lightning_recsys.parallel / planner / checkpoint."""

from lightning_recsys._registration import register_strategy_name
from lightning_recsys.strategies.checkpoint_io import DCPCheckpointIO
from lightning_recsys.strategies.twod_rec import TwoDRecStrategy

register_strategy_name()  # Lightning is imported by now: registers at once

__all__ = ["DCPCheckpointIO", "TwoDRecStrategy"]

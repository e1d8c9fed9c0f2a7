"""Lightning strategies: map Trainer hooks onto lightning_recsys.parallel / planner."""

from lightning_recsys.strategies.twod_rec import TwoDRecStrategy

__all__ = ["TwoDRecStrategy"]

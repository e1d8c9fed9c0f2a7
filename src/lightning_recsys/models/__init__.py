"""Single-device ranker LightningModules and metrics (no process-group code)."""

from lightning_recsys.models.base import RankerModule
from lightning_recsys.models.dlrm import DLRMRanker
from lightning_recsys.models.metrics import NormalizedEntropy

__all__ = ["DLRMRanker", "NormalizedEntropy", "RankerModule"]

"""Single-device LightningModules and metrics (no process-group code)."""

from lightning_recsys.models.base import RankerModule, RecsysModule
from lightning_recsys.models.dcn import DCNRanker
from lightning_recsys.models.dlrm import DLRMRanker
from lightning_recsys.models.metrics import AUC, Calibration, LogLoss, NormalizedEntropy
from lightning_recsys.models.pretrainer import SequencePretrainer
from lightning_recsys.models.ranking_metrics import RankingMetrics
from lightning_recsys.models.sequence import SequenceRanker

__all__ = [
    "AUC", "Calibration", "DCNRanker", "DLRMRanker", "LogLoss", "NormalizedEntropy", "RankerModule", "RankingMetrics", "RecsysModule",
    "SequencePretrainer", "SequenceRanker",
]

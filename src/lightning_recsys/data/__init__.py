"""DataModules producing RecBatch: synthetic click logs (default)."""

from lightning_recsys.data.batch import RecBatch, sparse_feature_names
from lightning_recsys.data.synthetic import (
    SyntheticClickLog,
    SyntheticClickLogConfig,
    SyntheticClickLogDataModule,
    slice_batch,
)

__all__ = [
    "RecBatch",
    "SyntheticClickLog",
    "SyntheticClickLogConfig",
    "SyntheticClickLogDataModule",
    "slice_batch",
    "sparse_feature_names",
]

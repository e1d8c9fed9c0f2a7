"""DataModules, grouped by source: ``criteo/`` (TSV or npy), ``movielens/`` (MovieLens-100k), ``synthetic/``
(no file), ``sequences/`` (BERT4Rec/SASRec sequence files and the leave-one-out examples every pretraining
source shares) and ``parquet/`` (prepared per-user parquet at any scale).

Every source yields ``RecBatch`` (clicks, for rankers) or ``SequenceBatch`` (next-item pretraining), cuts
work between ranks by one rule (``ranks.py``) and reads the names its features share with the models
from ``lightning_recsys.contracts``.
"""

from lightning_recsys.data.batch import RecBatch, SequenceBatch, sparse_feature_names
from lightning_recsys.data.criteo import (
    CRITEO_FEATURE_NAMES,
    CriteoArrowDataset,
    CriteoBinaryConfig,
    CriteoBinaryDataModule,
    CriteoBinaryDataset,
    CriteoConfig,
    CriteoDataModule,
    CriteoDataset,
)
from lightning_recsys.data.moved import install_moved_module_finder
from lightning_recsys.data.movielens import (
    MOVIELENS_FEATURE_NAMES,
    MOVIELENS_SEQUENCE_FEATURE_NAMES,
    MovieLens100K,
    MovieLens100KConfig,
    MovieLens100KDataModule,
    MovieLens100KDataset,
    MovieLens100KSequenceConfig,
    MovieLens100KSequenceDataModule,
    MovieLensPretrainDataModule,
)
from lightning_recsys.data.readers import MalformedLineError
from lightning_recsys.data.sequences import SequenceFileDataModule, SequenceFileRankingDataModule
from lightning_recsys.data.synthetic import (
    SyntheticClickLog,
    SyntheticClickLogConfig,
    SyntheticClickLogDataModule,
    SyntheticPretrainDataModule,
    SyntheticSequenceConfig,
    SyntheticSequenceDataModule,
    SyntheticSequenceLog,
    slice_batch,
)

install_moved_module_finder()

__all__ = [
    "CRITEO_FEATURE_NAMES",
    "CriteoArrowDataset",
    "CriteoBinaryConfig",
    "CriteoBinaryDataModule",
    "CriteoBinaryDataset",
    "CriteoConfig",
    "CriteoDataModule",
    "CriteoDataset",
    "MOVIELENS_FEATURE_NAMES",
    "MalformedLineError",
    "MovieLens100K",
    "MovieLens100KConfig",
    "MovieLens100KDataModule",
    "MovieLens100KDataset",
    "MOVIELENS_SEQUENCE_FEATURE_NAMES",
    "MovieLensPretrainDataModule",
    "MovieLens100KSequenceConfig",
    "MovieLens100KSequenceDataModule",
    "RecBatch",
    "SequenceBatch",
    "SequenceFileDataModule",
    "SequenceFileRankingDataModule",
    "SyntheticClickLog",
    "SyntheticClickLogConfig",
    "SyntheticClickLogDataModule",
    "SyntheticPretrainDataModule",
    "SyntheticSequenceConfig",
    "SyntheticSequenceDataModule",
    "SyntheticSequenceLog",
    "slice_batch",
    "sparse_feature_names",
]

"""DataModules producing RecBatch (synthetic click logs (default) and histories, MovieLens-100k and Criteo files, TSV or npy)
and SequenceBatch for next-item pretraining (sequence files, MovieLens-100k, synthetic: ``data.sequences``)."""

from lightning_recsys.data.batch import RecBatch, SequenceBatch, sparse_feature_names
from lightning_recsys.data.criteo import CRITEO_FEATURE_NAMES, CriteoConfig, CriteoDataModule, CriteoDataset
from lightning_recsys.data.criteo_arrow import CriteoArrowDataset
from lightning_recsys.data.criteo_binary import CriteoBinaryConfig, CriteoBinaryDataModule, CriteoBinaryDataset
from lightning_recsys.data.movielens import (
    MOVIELENS_FEATURE_NAMES,
    MovieLens100K,
    MovieLens100KConfig,
    MovieLens100KDataModule,
    MovieLens100KDataset,
)
from lightning_recsys.data.movielens_sequence import (
    MOVIELENS_SEQUENCE_FEATURE_NAMES,
    MovieLens100KSequenceConfig,
    MovieLens100KSequenceDataModule,
)
from lightning_recsys.data.readers import MalformedLineError
from lightning_recsys.data.sequences import (
    MovieLensPretrainDataModule,
    SequenceFileDataModule,
    SequenceFileRankingDataModule,
    SyntheticPretrainDataModule,
)
from lightning_recsys.data.synthetic import (
    SyntheticClickLog,
    SyntheticClickLogConfig,
    SyntheticClickLogDataModule,
    slice_batch,
)
from lightning_recsys.data.synthetic_sequence import (
    SyntheticSequenceConfig,
    SyntheticSequenceDataModule,
    SyntheticSequenceLog,
)

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

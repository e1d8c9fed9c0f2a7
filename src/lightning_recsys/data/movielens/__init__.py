"""MovieLens-100k: rated clicks (``ratings.py``), clicks with the user's history (``histories.py``) and
ratings by time as pretraining sequences (``pretrain.py``)."""

from lightning_recsys.data.movielens.histories import (
    MOVIELENS_SEQUENCE_FEATURE_NAMES,
    MovieLens100KSequenceConfig,
    MovieLens100KSequenceDataModule,
)
from lightning_recsys.data.movielens.pretrain import MOVIELENS_ACTION_TYPES, MovieLensPretrainDataModule, movielens_sequences
from lightning_recsys.data.movielens.ratings import (
    MOVIELENS_FEATURE_NAMES,
    MovieLens100K,
    MovieLens100KConfig,
    MovieLens100KDataModule,
    MovieLens100KDataset,
)

__all__ = [
    "MOVIELENS_ACTION_TYPES",
    "MOVIELENS_FEATURE_NAMES",
    "MOVIELENS_SEQUENCE_FEATURE_NAMES",
    "MovieLens100K",
    "MovieLens100KConfig",
    "MovieLens100KDataModule",
    "MovieLens100KDataset",
    "MovieLens100KSequenceConfig",
    "MovieLens100KSequenceDataModule",
    "MovieLensPretrainDataModule",
    "movielens_sequences",
]

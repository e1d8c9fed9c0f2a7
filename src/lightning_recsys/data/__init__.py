"""DataModules, grouped by source: ``criteo/`` (TSV or npy), ``movielens/`` (MovieLens-100k), ``synthetic/``
(no file), ``sequences/`` (BERT4Rec/SASRec sequence files and the leave-one-out examples every pretraining
source shares) and ``parquet/`` (prepared per-user parquet at any scale).

Every source yields ``RecBatch`` (clicks, for rankers) or ``SequenceBatch`` (next-item pretraining), cuts
work between ranks by one rule (``ranks.py``) and reads the names its features share with the models
from ``lightning_recsys.contracts``.
"""

from __future__ import annotations

from lightning_recsys._lazy import lazy_exports
from lightning_recsys.data.moved import install_moved_module_finder

# Imported on first use, so that `lightning-recsys prepare` and the parquet contract load without torch or Lightning.
_EXPORTS = {
    "CRITEO_FEATURE_NAMES": "lightning_recsys.data.criteo",
    "CriteoArrowDataset": "lightning_recsys.data.criteo",
    "CriteoBinaryConfig": "lightning_recsys.data.criteo",
    "CriteoBinaryDataModule": "lightning_recsys.data.criteo",
    "CriteoBinaryDataset": "lightning_recsys.data.criteo",
    "CriteoConfig": "lightning_recsys.data.criteo",
    "CriteoDataModule": "lightning_recsys.data.criteo",
    "CriteoDataset": "lightning_recsys.data.criteo",
    "MOVIELENS_FEATURE_NAMES": "lightning_recsys.data.movielens",
    "MOVIELENS_SEQUENCE_FEATURE_NAMES": "lightning_recsys.data.movielens",
    "MovieLens100K": "lightning_recsys.data.movielens",
    "MovieLens100KConfig": "lightning_recsys.data.movielens",
    "MovieLens100KDataModule": "lightning_recsys.data.movielens",
    "MovieLens100KDataset": "lightning_recsys.data.movielens",
    "MovieLens100KSequenceConfig": "lightning_recsys.data.movielens",
    "MovieLens100KSequenceDataModule": "lightning_recsys.data.movielens",
    "MovieLensPretrainDataModule": "lightning_recsys.data.movielens",
    "SyntheticClickLog": "lightning_recsys.data.synthetic",
    "SyntheticClickLogConfig": "lightning_recsys.data.synthetic",
    "SyntheticClickLogDataModule": "lightning_recsys.data.synthetic",
    "SyntheticPretrainDataModule": "lightning_recsys.data.synthetic",
    "SyntheticSequenceConfig": "lightning_recsys.data.synthetic",
    "SyntheticSequenceDataModule": "lightning_recsys.data.synthetic",
    "SyntheticSequenceLog": "lightning_recsys.data.synthetic",
    "slice_batch": "lightning_recsys.data.synthetic",
    "RecBatch": "lightning_recsys.data.batch",
    "SequenceBatch": "lightning_recsys.data.batch",
    "sparse_feature_names": "lightning_recsys.data.batch",
    "MalformedLineError": "lightning_recsys.data.readers",
    "SequenceFileDataModule": "lightning_recsys.data.sequences",
    "SequenceFileRankingDataModule": "lightning_recsys.data.sequences",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

install_moved_module_finder()

__all__ = sorted(_EXPORTS)

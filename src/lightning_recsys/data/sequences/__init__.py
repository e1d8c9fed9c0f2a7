"""Leave-one-out next-item examples (``split.py``, ``module.py``: the split, batches, ranks and negatives every
pretraining source shares) and their text source, BERT4Rec/SASRec sequence files:

- ``SequenceFileDataModule``: a ``user item`` file (``reader.py``, ``files.py``).
- ``SequenceFileRankingDataModule``: DIN-style implicit-feedback ranking pairs from a sequence file
  (``RecBatch`` for ``SequenceRanker``, ``ranking.py``).

The other pretraining sources live with their data: ``data.movielens`` (MovieLens-100k by time),
``data.synthetic`` (planted chains) and ``data.parquet`` (prepared per-user parquet).
"""

from lightning_recsys.contracts.names import ACTION_FEATURE, ITEM_FEATURE, NEGATIVE_FEATURE, NEXT_ITEM_FEATURE
from lightning_recsys.data.moved import moved_name_error
from lightning_recsys.data.sequences.files import SequenceFileDataModule
from lightning_recsys.data.sequences.module import SequencePretrainDataModule, SequenceSplitDataset
from lightning_recsys.data.sequences.ranking import SequenceFileRankingDataModule
from lightning_recsys.data.sequences.reader import UserSequences, read_sequence_file
from lightning_recsys.data.sequences.split import LeaveOneOutSplit, sequence_batch

__all__ = [
    "ACTION_FEATURE",
    "ITEM_FEATURE",
    "LeaveOneOutSplit",
    "NEGATIVE_FEATURE",
    "NEXT_ITEM_FEATURE",
    "SequenceFileDataModule",
    "SequenceFileRankingDataModule",
    "SequencePretrainDataModule",
    "SequenceSplitDataset",
    "UserSequences",
    "read_sequence_file",
    "sequence_batch",
]

_MOVED = {
    "MOVIELENS_ACTION_TYPES": "lightning_recsys.data.movielens",
    "MovieLensPretrainDataModule": "lightning_recsys.data.movielens",
    "movielens_sequences": "lightning_recsys.data.movielens",
    "PlantedChains": "lightning_recsys.data.synthetic",
    "SyntheticPretrainDataModule": "lightning_recsys.data.synthetic",
    "planted_sequences": "lightning_recsys.data.synthetic",
}


def __getattr__(name: str) -> object:
    raise moved_name_error(__name__, name, _MOVED)

"""Activity sequences for next-item pretraining: DataModules of ``SequenceBatch`` over a leave-one-out split.

- ``SequenceFileDataModule``: a BERT4Rec/SASRec ``user item`` file (``reader.py``).
- ``MovieLensPretrainDataModule``: MovieLens-100k ratings by time, the rating as the action.
- ``SyntheticPretrainDataModule``: planted successor chains, no file.
- ``SequenceFileRankingDataModule``: DIN-style implicit-feedback ranking pairs from a sequence file
  (``RecBatch`` for ``SequenceRanker``, ``ranking.py``).

The split (``split.py``) and the batches, ranks and negatives (``module.py``) are shared.
"""

from lightning_recsys.data.sequences.files import SequenceFileDataModule
from lightning_recsys.data.sequences.module import SequencePretrainDataModule, SequenceSplitDataset
from lightning_recsys.data.sequences.movielens import MOVIELENS_ACTION_TYPES, MovieLensPretrainDataModule, movielens_sequences
from lightning_recsys.data.sequences.ranking import SequenceFileRankingDataModule
from lightning_recsys.data.sequences.reader import UserSequences, read_sequence_file
from lightning_recsys.data.sequences.split import (
    ACTION_FEATURE,
    ITEM_FEATURE,
    NEGATIVE_FEATURE,
    NEXT_ITEM_FEATURE,
    LeaveOneOutSplit,
    sequence_batch,
)
from lightning_recsys.data.sequences.synthetic import PlantedChains, SyntheticPretrainDataModule, planted_sequences

__all__ = [
    "ACTION_FEATURE",
    "ITEM_FEATURE",
    "LeaveOneOutSplit",
    "MOVIELENS_ACTION_TYPES",
    "MovieLensPretrainDataModule",
    "NEGATIVE_FEATURE",
    "NEXT_ITEM_FEATURE",
    "PlantedChains",
    "SequenceFileDataModule",
    "SequenceFileRankingDataModule",
    "SequencePretrainDataModule",
    "SequenceSplitDataset",
    "SyntheticPretrainDataModule",
    "UserSequences",
    "movielens_sequences",
    "planted_sequences",
    "read_sequence_file",
    "sequence_batch",
]

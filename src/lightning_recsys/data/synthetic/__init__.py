"""Synthetic data, no file: click logs (``click_log.py``), clicks with histories (``sequence_log.py``) and
planted successor chains for pretraining (``planted_chains.py``)."""

from lightning_recsys.data.synthetic.click_log import (
    SyntheticClickLog,
    SyntheticClickLogConfig,
    SyntheticClickLogDataModule,
    slice_batch,
)
from lightning_recsys.data.synthetic.planted_chains import PlantedChains, SyntheticPretrainDataModule, planted_sequences
from lightning_recsys.data.synthetic.sequence_log import (
    SyntheticSequenceConfig,
    SyntheticSequenceDataModule,
    SyntheticSequenceLog,
)

__all__ = [
    "PlantedChains",
    "SyntheticClickLog",
    "SyntheticClickLogConfig",
    "SyntheticClickLogDataModule",
    "SyntheticPretrainDataModule",
    "SyntheticSequenceConfig",
    "SyntheticSequenceDataModule",
    "SyntheticSequenceLog",
    "planted_sequences",
    "slice_batch",
]

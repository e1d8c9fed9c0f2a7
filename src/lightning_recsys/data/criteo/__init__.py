"""Criteo click logs: the TSV/gzip day files (``tsv.py``, parsed by ``parse.py`` or pyarrow in ``arrow.py``)
and TorchRec's npy files (``binary.py``, converted by ``to_npy.py``); the shared format in ``format.py``."""

from lightning_recsys.data.criteo.arrow import CriteoArrowDataset
from lightning_recsys.data.criteo.binary import CriteoBinaryConfig, CriteoBinaryDataModule, CriteoBinaryDataset
from lightning_recsys.data.criteo.format import CRITEO_FEATURE_NAMES, CriteoConfig
from lightning_recsys.data.criteo.tsv import CriteoDataModule, CriteoDataset

__all__ = [
    "CRITEO_FEATURE_NAMES",
    "CriteoArrowDataset",
    "CriteoBinaryConfig",
    "CriteoBinaryDataModule",
    "CriteoBinaryDataset",
    "CriteoConfig",
    "CriteoDataModule",
    "CriteoDataset",
]

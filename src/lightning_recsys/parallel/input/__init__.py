"""Input: batch checks and the per-step handshake between ranks (``GuardConfig``), the sparse-dist
pipeline, and where a training epoch is in its loader."""

from lightning_recsys.parallel.input.batch_check import InputValidator, InvalidInputError, feature_tables
from lightning_recsys.parallel.input.guard_config import GuardConfig
from lightning_recsys.parallel.input.input_guard import CoordinatedBatches
from lightning_recsys.parallel.input.input_pipeline import PIPELINE_MODES, PipelineMode, SparseDistPipeline
from lightning_recsys.parallel.input.length_rules import FeatureLengthRules, module_length_rules
from lightning_recsys.parallel.input.loader_position import LoaderPosition

__all__ = [
    "CoordinatedBatches",
    "FeatureLengthRules",
    "GuardConfig",
    "InputValidator",
    "InvalidInputError",
    "LoaderPosition",
    "PIPELINE_MODES",
    "PipelineMode",
    "SparseDistPipeline",
    "feature_tables",
    "module_length_rules",
]

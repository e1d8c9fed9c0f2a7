"""Contracts shared by data, models, the planner and the runtime: names and protocols, defined once.

Nothing here imports Lightning, TorchRec or any other layer of this package (``tests/unit/test_layering.py``).
"""

from lightning_recsys.contracts.encoder import EncoderFactory, SequenceEncoder, check_encoder
from lightning_recsys.contracts.length_rules import FeatureLengthRules, length_rule_problems, module_length_rules
from lightning_recsys.contracts.names import (
    ACTION_FEATURE,
    ACTION_TABLE,
    ITEM_FEATURE,
    ITEM_TABLE,
    NEGATIVE_FEATURE,
    NEXT_ITEM_FEATURE,
    SEQUENCE_ITEM_FEATURES,
)
from lightning_recsys.contracts.ranking import ItemRanking, ItemRankingProvider
from lightning_recsys.contracts.warm_start import (
    ENCODER_ROLE,
    ITEM_TABLE_ROLE,
    WARM_START_ROLES,
    WarmStartable,
    WarmStartPart,
)

__all__ = [
    "ACTION_FEATURE",
    "ACTION_TABLE",
    "ENCODER_ROLE",
    "EncoderFactory",
    "FeatureLengthRules",
    "ITEM_FEATURE",
    "ITEM_TABLE",
    "ITEM_TABLE_ROLE",
    "ItemRanking",
    "ItemRankingProvider",
    "NEGATIVE_FEATURE",
    "NEXT_ITEM_FEATURE",
    "SEQUENCE_ITEM_FEATURES",
    "SequenceEncoder",
    "WARM_START_ROLES",
    "WarmStartPart",
    "WarmStartable",
    "check_encoder",
    "length_rule_problems",
    "module_length_rules",
]

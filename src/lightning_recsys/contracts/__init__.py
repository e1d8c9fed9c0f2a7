"""Contracts shared by data, models, the planner and the runtime: names and protocols, defined once.

Nothing here imports Lightning, TorchRec's distributed code or any other layer of this package.
"""

from lightning_recsys.contracts.names import (
    ACTION_FEATURE,
    ACTION_TABLE,
    ITEM_FEATURE,
    ITEM_TABLE,
    NEGATIVE_FEATURE,
    NEXT_ITEM_FEATURE,
    SEQUENCE_ITEM_FEATURES,
)

__all__ = [
    "ACTION_FEATURE",
    "ACTION_TABLE",
    "ITEM_FEATURE",
    "ITEM_TABLE",
    "NEGATIVE_FEATURE",
    "NEXT_ITEM_FEATURE",
    "SEQUENCE_ITEM_FEATURES",
]

"""``SequenceDataShape``: what a DataModule of clicks with user histories tells ``SequenceRanker`` about its batches."""

from __future__ import annotations

from typing import Any


class SequenceDataShape:
    """The six attributes a ``SequenceRanker`` is built from, read off the DataModule's ``config``.

    Its ``config`` has ``num_items`` (the item table's rows), ``num_action_types``,
    ``context_feature_names``, ``context_table_sizes``, ``num_dense_features`` and ``max_history_length``.
    """

    config: Any  # SyntheticSequenceConfig, MovieLens100KSequenceConfig: the six fields above

    @property
    def item_table_size(self) -> int:
        return int(self.config.num_items)

    @property
    def num_action_types(self) -> int:
        return int(self.config.num_action_types)

    @property
    def context_feature_names(self) -> list[str]:
        return list(self.config.context_feature_names)

    @property
    def context_table_sizes(self) -> list[int]:
        return list(self.config.context_table_sizes)

    @property
    def num_dense_features(self) -> int:
        return int(self.config.num_dense_features)

    @property
    def max_history_length(self) -> int:
        return int(self.config.max_history_length)

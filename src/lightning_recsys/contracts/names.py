"""The feature and table names that the sequence data, the sequence models and the cost model share.

A ``SequenceBatch``'s ``KeyedJaggedTensor`` carries these features; ``SequencePretrainer`` and
``SequenceRanker`` look the item features up in one table, ``ITEM_TABLE``.
"""

from __future__ import annotations

ITEM_TABLE = "item"  # the item embedding table of every sequence model
ACTION_TABLE = "action"  # the action-type table, where the data has actions

ITEM_FEATURE = "item_id"  # each example's input items, oldest first
NEXT_ITEM_FEATURE = "next_item_id"  # the item after each input (the targets), with ITEM_FEATURE's lengths
NEGATIVE_FEATURE = "negative_item_id"  # the local batch's shared pool of sampled negatives
ACTION_FEATURE = "action"  # one action type per input item

# The features that read ITEM_TABLE, in the order the pretraining batches hold them.
SEQUENCE_ITEM_FEATURES: tuple[str, ...] = (ITEM_FEATURE, NEXT_ITEM_FEATURE, NEGATIVE_FEATURE)

# A ranker's click examples with the user's history (SequenceRanker's default feature names).
HISTORY_ITEM_FEATURE = "history_item_id"  # the user's past items, oldest first
HISTORY_ACTION_FEATURE = "history_action"  # one action type per past item
CANDIDATE_ITEM_FEATURE = "candidate_item_id"  # the item the click label is about

"""The item (and action) tables of the sequence models, built one way: so a warm start finds the same table in both.

``SequencePretrainer`` and ``SequenceRanker`` (with a causal encoder) look their item features up in one
``EmbeddingCollection``: table ``contracts.names.ITEM_TABLE`` and, with actions, ``ACTION_TABLE`` beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig

from lightning_recsys.contracts.names import ACTION_TABLE, ITEM_TABLE
from lightning_recsys.contracts.warm_start import WarmStartPart

__all__ = ["ITEM_INIT_STD", "item_table_part", "sequence_tables"]

ITEM_INIT_STD = 0.02  # SASRec+'s: the tables start as N(0, 0.02)


def sequence_tables(
    *,
    num_items: int,
    num_action_types: int,
    embedding_dim: int,
    item_features: Sequence[str],
    action_features: Sequence[str],
    init_std: float,
    device: torch.device | None,
) -> EmbeddingCollection:
    """One ``EmbeddingCollection``: ``ITEM_TABLE`` read by ``item_features`` and, with ``num_action_types > 0``,
    ``ACTION_TABLE`` read by ``action_features``; both start ``N(0, init_std)`` (``EmbeddingConfig.init_fn``, which
    TorchRec also applies to the shards of a table built on ``meta``)."""
    initial = partial(nn.init.normal_, mean=0.0, std=init_std)
    tables = [
        EmbeddingConfig(
            name=ITEM_TABLE, embedding_dim=embedding_dim, num_embeddings=num_items, feature_names=list(item_features), init_fn=initial
        )
    ]
    if num_action_types > 0:
        tables.append(
            EmbeddingConfig(
                name=ACTION_TABLE, embedding_dim=embedding_dim, num_embeddings=num_action_types,
                feature_names=list(action_features), init_fn=initial,
            )
        )
    return EmbeddingCollection(tables=tables, device=device)


def item_table_part(attribute: str) -> WarmStartPart:
    """The item table's warm-start part in an ``EmbeddingCollection`` held as ``attribute``."""
    return WarmStartPart(prefix=f"{attribute}.embeddings.{ITEM_TABLE}.", kind="table")

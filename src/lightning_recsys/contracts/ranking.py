"""The item-ranking service: what a model asks for to rank every item of its item table, and who hands it one.

A pretrainer's evaluation ranks the whole item table for each user. Unsharded, the model ranks its own
table (``lightning_recsys.ranking.UnshardedItemRanking``); sharded, only the runtime can, inside the
table's sharding group. The model does not know which: it asks the Trainer's strategy through
``ItemRankingProvider`` (``TwoDRecStrategy`` implements it) and ranks its own table when the strategy
is not one.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["ItemRanking", "ItemRankingProvider"]


class ItemRanking(Protocol):
    """Exact full ranking of an item table for query vectors ``[B, D]``.

    A user's score for item ``j`` is ``query · table[j]`` (``table[j] / ||table[j]||`` with ``normalize_rows``).
    Ties count against the target; the items a user has seen (``seen_ids``, jagged by ``seen_lengths``) are
    never counted nor returned. ``lightning_recsys.ranking.unsharded`` states the protocol in full.
    """

    def target_ranks(
        self, queries: torch.Tensor, target_ids: torch.Tensor, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> torch.Tensor:
        """``[B]`` int64: how many unseen items other than the target score at least the target's score."""
        ...

    def top_k(
        self, queries: torch.Tensor, k: int, seen_ids: torch.Tensor, seen_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores, ids)``, each ``[B, min(k, num_items)]``: the best unseen items, best first (ties: lower id first)."""
        ...


@runtime_checkable
class ItemRankingProvider(Protocol):
    """A runtime that ranks a (possibly sharded) item table: ``TwoDRecStrategy`` is one.

    ``item_ranking(module, table_name, normalize_rows=...)``: ``module`` is the model's
    ``EmbeddingCollection`` attribute (or the sharded module in its place), ``table_name`` the table to rank.
    The table is read when it is called: call it again after the weights change (once per evaluation loop).
    """

    def item_ranking(self, module: nn.Module, table_name: str, normalize_rows: bool = False) -> ItemRanking:
        ...

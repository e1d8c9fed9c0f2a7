"""Single-device full ranking of an item table (brute force, in row chunks): the reference, and what an unsharded model uses.

It imports only ``lightning_recsys.contracts``: ``models/`` rank with it without importing the runtime, and
``parallel.ranking`` (the sharded ranking) shares its chunk arithmetic.
"""

from lightning_recsys.contracts.ranking import ItemRanking, ItemRankingProvider
from lightning_recsys.ranking.chunks import DEFAULT_BLOCK_BYTES, DEFAULT_CHUNK_ROWS, merge_top_k
from lightning_recsys.ranking.unsharded import UnshardedItemRanking, seen_mask

__all__ = [
    "DEFAULT_BLOCK_BYTES", "DEFAULT_CHUNK_ROWS", "ItemRanking", "ItemRankingProvider", "UnshardedItemRanking", "merge_top_k", "seen_mask",
]

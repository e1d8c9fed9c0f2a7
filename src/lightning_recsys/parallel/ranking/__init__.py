"""Full ranking of every item of an item table for a batch of user query vectors: exact target ranks and top-K.

``UnshardedItemRanking`` scores a whole table held in one process (brute force, in row chunks).
The sharded ranking, over a TorchRec-sharded table, returns the same results.
"""

from lightning_recsys.parallel.ranking.unsharded import ItemRanking, UnshardedItemRanking, seen_mask

__all__ = ["ItemRanking", "UnshardedItemRanking", "seen_mask"]

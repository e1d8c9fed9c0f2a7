"""Full ranking of every item of an item table for a batch of user query vectors: exact target ranks and top-K.

``UnshardedItemRanking`` scores a whole table held in one process (brute force, in row chunks): the reference.
``ShardedItemRanking`` ranks a TorchRec-sharded ``EmbeddingCollection`` table inside its sharding group, with
the same results; ``make_item_ranking`` picks the one a module needs.
"""

from lightning_recsys.parallel.ranking.sharded import ShardedItemRanking, make_item_ranking
from lightning_recsys.ranking.unsharded import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CHUNK_ROWS,
    ItemRanking,
    UnshardedItemRanking,
    merge_top_k,
    seen_mask,
)

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_CHUNK_ROWS",
    "ItemRanking",
    "ShardedItemRanking",
    "UnshardedItemRanking",
    "make_item_ranking",
    "merge_top_k",
    "seen_mask",
]

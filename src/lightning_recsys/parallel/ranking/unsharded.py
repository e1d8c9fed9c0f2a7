"""Moved to ``lightning_recsys.ranking.unsharded`` (single-device code that models use too); re-exported here."""

from lightning_recsys.ranking.unsharded import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CHUNK_ROWS,
    ItemRanking,
    SeenItems,
    UnshardedItemRanking,
    check_k,
    chunk_candidates,
    merge_top_k,
    ranking_input_problem,
    rows_per_chunk,
    seen_mask,
)

__all__ = [
    "DEFAULT_BLOCK_BYTES", "DEFAULT_CHUNK_ROWS", "ItemRanking", "SeenItems", "UnshardedItemRanking", "check_k", "chunk_candidates",
    "merge_top_k", "ranking_input_problem", "rows_per_chunk", "seen_mask",
]

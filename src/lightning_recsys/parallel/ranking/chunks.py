"""Moved to ``lightning_recsys.ranking.chunks`` (single-device code that models use too); re-exported here."""

from lightning_recsys.ranking.chunks import (
    DEFAULT_BLOCK_BYTES,
    DEFAULT_CHUNK_ROWS,
    MAX_CHUNK_ROWS,
    RunningTopK,
    ScoreBlock,
    SeenItems,
    best_of_block,
    check_chunking,
    chunk_candidates,
    chunk_scores,
    count_at_least,
    merge_top_k,
    no_candidates,
    rows_per_chunk,
    scored_rows,
    target_scores,
)

__all__ = [
    "DEFAULT_BLOCK_BYTES", "DEFAULT_CHUNK_ROWS", "MAX_CHUNK_ROWS", "RunningTopK", "ScoreBlock", "SeenItems", "best_of_block",
    "check_chunking", "chunk_candidates", "chunk_scores", "count_at_least", "merge_top_k", "no_candidates", "rows_per_chunk",
    "scored_rows", "target_scores",
]

"""The one rule by which every DataModule of this package cuts work between ranks.

Rank ``r`` of ``W`` takes the contiguous range ``[r * n // W, (r + 1) * n // W)`` of ``n`` things
(examples of a global batch, users of a prepared data set, rows of a file). The ranges tile
``[0, n)`` exactly, in rank order, and their sizes differ by at most one; when ``W`` divides ``n``
every rank takes ``n / W``.
"""

from __future__ import annotations


def check_rank(rank: int, world_size: int) -> None:
    """Raise ``ValueError`` unless ``0 <= rank < world_size`` and ``world_size >= 1``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size}).")


def rank_range(count: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)``: the part of ``count`` things that ``rank`` of ``world_size`` takes (see the module docstring)."""
    check_rank(rank, world_size)
    if count < 0:
        raise ValueError(f"count={count} must be >= 0.")
    return rank * count // world_size, (rank + 1) * count // world_size


def check_divisible(global_batch_size: int, world_size: int) -> None:
    """Training batches are cut evenly: raise unless ``world_size`` divides ``global_batch_size``."""
    if global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by the world size {world_size}; "
            f"use a multiple of {world_size}."
        )


def even_rank_range(global_batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``rank_range`` of a training global batch, which must divide evenly between the ranks."""
    check_divisible(global_batch_size, world_size)
    return rank_range(global_batch_size, rank, world_size)

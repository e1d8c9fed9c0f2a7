"""Bandwidth-aware reshape advice: which tables to halve in dim and double in rows.

A pooled embedding crosses the all-to-all as one ``dim``-wide vector per bag, so a table reshaped
from ``(rows, dim)`` to ``(2 rows, dim / 2)`` keeps its parameter count and halves its pooled
payload; only the ids routed to it stay the same. ``suggest_reshape`` proposes this where the
saving is worth it; ``lightning_recsys.parallel.sharding.reshape.apply_reshape`` rebuilds the model's
collections accordingly (what that changes for the user is described there).

No Lightning imports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from lightning_recsys.planner.shard_cost import CommCosts
from lightning_recsys.planner.stats import TableStats


@dataclass(frozen=True)
class ReshapeAdvice:
    """Reshape ``table`` from ``(rows, dim)`` to ``(new_rows, new_dim)``; a2a bytes per step before and after."""

    table: str
    rows: int
    dim: int
    new_rows: int
    new_dim: int
    bytes_before: float
    bytes_after: float

    def __post_init__(self) -> None:
        if self.new_rows * self.new_dim != self.rows * self.dim:
            raise ValueError(
                f"ReshapeAdvice({self.table!r}): {self.new_rows} x {self.new_dim} does not keep the parameter count of "
                f"{self.rows} x {self.dim}."
            )

    @property
    def saving(self) -> float:
        """The share of the table's a2a bytes the reshape removes."""
        return 1.0 - self.bytes_after / self.bytes_before if self.bytes_before > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "saving": self.saving}


def table_exchange_bytes(
    dim: int, *, lookups_per_example: float, batch_size: int, sharding_group_size: int, comm: CommCosts
) -> float:
    """Per-step a2a bytes of one pooled table placed table-wise: outputs, gradients and ids (see ``shard_cost``)."""
    peers = sharding_group_size - 1
    return batch_size * peers * (comm.pooled_all_to_all.row_bytes(dim) + lookups_per_example * comm.index_bytes)


def suggest_reshape(
    tables: Sequence[BaseEmbeddingConfig],
    *,
    stats: Mapping[str, TableStats] | None = None,
    batch_size: int = 512,
    sharding_group_size: int = 8,
    comm_costs: CommCosts | None = None,
    min_dim: int = 8,
    alignment: int = 4,
    max_rows: int = 2**31 - 1,
    min_saving: float = 0.1,
) -> list[ReshapeAdvice]:
    """Tables of pooled collections (``EmbeddingBagConfig``) worth reshaping to ``(2 rows, dim / 2)``.

    A table qualifies when ``dim / 2`` is at least ``min_dim`` and a multiple of ``alignment``
    (FBGEMM's row alignment), ``2 rows <= max_rows``, and the reshape cuts its per-step a2a bytes
    by at least ``min_saving`` (tables dominated by their ids gain little).
    """
    if not 0 <= min_saving < 1:
        raise ValueError(f"suggest_reshape(min_saving={min_saving}) must be in [0, 1).")
    if min_dim < 1 or alignment < 1:
        raise ValueError(f"suggest_reshape(min_dim={min_dim}, alignment={alignment}) must both be >= 1.")
    if sharding_group_size < 1 or batch_size < 1:
        raise ValueError(f"suggest_reshape(sharding_group_size={sharding_group_size}, batch_size={batch_size}) must both be >= 1.")
    comm = comm_costs or CommCosts()
    advice: list[ReshapeAdvice] = []
    for table in tables:
        if not isinstance(table, EmbeddingBagConfig):
            continue  # sequence tables send one vector per id; a projection would not restore their layout
        dim, rows = table.embedding_dim, table.num_embeddings
        new_dim = dim // 2
        if dim % 2 or new_dim < min_dim or new_dim % alignment or 2 * rows > max_rows:
            continue
        table_stats = (stats or {}).get(table.name)
        lookups = table_stats.lookups_per_example if table_stats else float(len(table.feature_names))
        before, after = (
            table_exchange_bytes(d, lookups_per_example=lookups, batch_size=batch_size, sharding_group_size=sharding_group_size, comm=comm)
            for d in (dim, new_dim)
        )
        if before <= 0 or 1 - after / before < min_saving:
            continue
        advice.append(ReshapeAdvice(table.name, rows, dim, 2 * rows, new_dim, before, after))
    return advice

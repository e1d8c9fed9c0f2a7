"""Observed embedding traffic: per-table statistics for the planner, explicit or profiled from data.

A table's load is what its features send to it: ``pooling_factor`` ids per feature per example,
``features`` features (bags) per example, and how those ids spread over the table's rows. The
spread matters for row-wise shards, which own contiguous row ranges: ``row_block_shares`` is the
share of lookups in each of ``len(row_block_shares)`` equal contiguous row blocks (None means the
ids are spread evenly, as after hashing). ``hot_row_share`` is the share of lookups that hit the
hottest ``hot_row_fraction`` of the rows.

No Lightning imports: ``profile_datamodule`` only needs an object with ``train_dataloader()``
yielding batches with a ``sparse`` KeyedJaggedTensor (``lightning_recsys.data.RecBatch``) or KJTs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

DEFAULT_ROW_BLOCKS = 1024
_SHARE_TOLERANCE = 1e-6


@dataclass(frozen=True, kw_only=True)
class TableStats:
    """Observed (or assumed) traffic of one embedding table, per example.

    Args:
        pooling_factor: mean ids per feature per example (TorchRec's pooling factor), > 0.
        features: features (bags) per example that look this table up, >= 1.
        hot_row_share: share of the table's lookups that hit its hottest ``hot_row_fraction`` of
            rows, in [0, 1]; None if unknown.
        hot_row_fraction: the fraction of rows counted as hot, in (0, 1].
        row_block_shares: share of the lookups in each equal, contiguous block of rows (they sum
            to 1); None means ids are spread evenly over the rows (hashed ids).
        sampled_lookups, sampled_distinct_rows: how many lookups a profile counted and how many
            distinct rows they hit (both or neither); the layout advice fits its id skew to them.
    """

    pooling_factor: float
    features: int = 1
    hot_row_share: float | None = None
    hot_row_fraction: float = 0.01
    row_block_shares: tuple[float, ...] | None = None
    sampled_lookups: int | None = None
    sampled_distinct_rows: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.pooling_factor, (int, float)) and self.pooling_factor > 0 and math.isfinite(self.pooling_factor)):
            raise ValueError(f"TableStats(pooling_factor={self.pooling_factor!r}) must be a finite number > 0 (ids per feature per example).")
        if isinstance(self.features, bool) or not isinstance(self.features, int) or self.features < 1:
            raise ValueError(f"TableStats(features={self.features!r}) must be an integer >= 1.")
        if self.hot_row_share is not None and not 0 <= self.hot_row_share <= 1:
            raise ValueError(f"TableStats(hot_row_share={self.hot_row_share}) must be in [0, 1] (a share of lookups).")
        sample = (self.sampled_lookups, self.sampled_distinct_rows)
        if (sample[0] is None) != (sample[1] is None) or (
            sample[0] is not None and not (isinstance(sample[0], int) and isinstance(sample[1], int) and 1 <= sample[1] <= sample[0])
        ):
            raise ValueError(
                f"TableStats(sampled_lookups={sample[0]!r}, sampled_distinct_rows={sample[1]!r}) must both be None or "
                "integers with 1 <= sampled_distinct_rows <= sampled_lookups."
            )
        if not 0 < self.hot_row_fraction <= 1:
            raise ValueError(f"TableStats(hot_row_fraction={self.hot_row_fraction}) must be in (0, 1].")
        if self.row_block_shares is not None:
            shares = tuple(float(s) for s in self.row_block_shares)
            if not shares or any(s < 0 or not math.isfinite(s) for s in shares):
                raise ValueError(
                    f"TableStats(row_block_shares=...) must be a non-empty sequence of finite shares >= 0; got {len(shares)} "
                    f"entries, min {min(shares) if shares else None}."
                )
            total = sum(shares)
            if abs(total - 1.0) > _SHARE_TOLERANCE * max(1, len(shares)):
                raise ValueError(f"TableStats(row_block_shares=...) must sum to 1 (they are shares of lookups); they sum to {total}.")
            object.__setattr__(self, "row_block_shares", shares)

    @property
    def lookups_per_example(self) -> float:
        """Ids per example over all of the table's features."""
        return self.pooling_factor * self.features

    def share_of_rows(self, start: int, stop: int, rows: int) -> float:
        """The share of this table's lookups that land in rows ``[start, stop)`` of ``rows``."""
        if rows < 1 or not 0 <= start <= stop <= rows:
            raise ValueError(f"share_of_rows(start={start}, stop={stop}, rows={rows}) needs 0 <= start <= stop <= rows.")
        if self.row_block_shares is None:
            return (stop - start) / rows
        blocks = self.row_block_shares
        # Block i covers rows [i * rows / n, (i + 1) * rows / n); a partial overlap counts pro rata.
        scale = len(blocks) / rows
        lo, hi = start * scale, stop * scale
        share = 0.0
        for i in range(int(lo), min(len(blocks), math.ceil(hi))):
            overlap = min(hi, i + 1) - max(lo, i)
            if overlap > 0:
                share += blocks[i] * overlap
        return share


@dataclass(frozen=True)
class FeatureProfile:
    """What profiling saw of one feature: examples, ids, and how often each id occurred."""

    examples: int
    ids: int
    unique_ids: torch.Tensor
    counts: torch.Tensor

    @property
    def pooling_factor(self) -> float:
        return self.ids / self.examples if self.examples else 0.0


@dataclass(frozen=True)
class LoadProfile:
    """Per-feature traffic observed over ``batches`` batches; turned into per-table stats for a model."""

    batches: int
    examples: int
    features: dict[str, FeatureProfile] = field(default_factory=dict)

    def table_stats(
        self, tables: Iterable[BaseEmbeddingConfig], *, row_blocks: int = DEFAULT_ROW_BLOCKS, hot_row_fraction: float = 0.01
    ) -> dict[str, TableStats]:
        """Per-table stats for ``tables`` (EmbeddingBagConfig/EmbeddingConfig), merging each table's features.

        Raises ``ValueError`` naming the table when none of its features was seen, or when an id
        is out of the table's range.
        """
        stats: dict[str, TableStats] = {}
        for table in tables:
            seen = [self.features[f] for f in table.feature_names if f in self.features]
            if not seen:
                raise ValueError(
                    f"profiling saw none of table {table.name!r}'s features {list(table.feature_names)} in {self.batches} "
                    f"batches (it saw {sorted(self.features)}); check the DataModule's feature names, or pass explicit TableStats."
                )
            ids = torch.cat([p.unique_ids for p in seen])
            counts = torch.cat([p.counts for p in seen])
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.num_embeddings):
                bad = int(ids.max()) if int(ids.max()) >= table.num_embeddings else int(ids.min())
                raise ValueError(
                    f"profiling saw id {bad} for table {table.name!r}, which has {table.num_embeddings} rows "
                    f"(features {list(table.feature_names)}); ids must be in [0, {table.num_embeddings})."
                )
            total_ids = sum(p.ids for p in seen)
            examples = max(p.examples for p in seen)
            pooling = total_ids / (examples * len(table.feature_names)) if examples else 0.0
            stats[table.name] = _stats_from_counts(
                ids,
                counts,
                rows=table.num_embeddings,
                features=len(table.feature_names),
                pooling_factor=pooling,
                row_blocks=row_blocks,
                hot_row_fraction=hot_row_fraction,
            )
        return stats


def _stats_from_counts(
    ids: torch.Tensor,
    counts: torch.Tensor,
    *,
    rows: int,
    features: int,
    pooling_factor: float,
    row_blocks: int,
    hot_row_fraction: float,
) -> TableStats:
    if ids.numel() == 0 or pooling_factor <= 0:
        # Every bag was empty: the table costs nothing but planning needs a positive factor.
        return TableStats(pooling_factor=1e-6, features=features, hot_row_fraction=hot_row_fraction)
    unique, inverse = torch.unique(ids, return_inverse=True)
    merged = torch.zeros(unique.numel(), dtype=torch.float64).index_add_(0, inverse, counts.to(torch.float64))
    total = float(merged.sum())
    hot_rows = max(1, math.ceil(hot_row_fraction * rows))
    hot = float(torch.topk(merged, min(hot_rows, merged.numel())).values.sum()) / total
    blocks = min(row_blocks, rows)
    block_of = torch.div(unique * blocks, rows, rounding_mode="floor")
    shares = torch.zeros(blocks, dtype=torch.float64).index_add_(0, block_of, merged) / total
    return TableStats(
        pooling_factor=pooling_factor,
        features=features,
        hot_row_share=min(1.0, hot),
        hot_row_fraction=hot_row_fraction,
        row_block_shares=tuple(shares.tolist()),
        sampled_lookups=max(int(round(total)), unique.numel()),
        sampled_distinct_rows=unique.numel(),
    )


class _HasTrainLoader(Protocol):
    def train_dataloader(self) -> Iterable[Any]: ...


def profile_datamodule(datamodule: _HasTrainLoader, batches: int, *, setup: bool = True) -> LoadProfile:
    """Count the ids of ``batches`` training batches of ``datamodule`` (a LightningDataModule or alike).

    ``setup=True`` calls ``datamodule.setup("fit")`` first, as the Trainer would. Batches must be
    ``RecBatch``-like (a ``sparse`` KeyedJaggedTensor) or KeyedJaggedTensors.
    """
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"profile(batches={batches!r}) must be an integer >= 1.")
    if setup and callable(getattr(datamodule, "setup", None)):
        datamodule.setup("fit")  # type: ignore[attr-defined]
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    ids_per_feature: dict[str, int] = {}
    examples = 0
    count = 0
    for batch in datamodule.train_dataloader():
        if count >= batches:
            break
        kjt = batch if isinstance(batch, KeyedJaggedTensor) else getattr(batch, "sparse", None)
        if not isinstance(kjt, KeyedJaggedTensor):
            raise TypeError(
                f"profile() needs batches with a `sparse` KeyedJaggedTensor (lightning_recsys.data.RecBatch) or KJTs; "
                f"got {type(batch).__name__}."
            )
        examples += kjt.stride()
        for name, jagged in kjt.to_dict().items():
            values = jagged.values().detach().to("cpu", torch.int64)
            ids_per_feature[name] = ids_per_feature.get(name, 0) + values.numel()
            unique, counts = torch.unique(values, return_counts=True)
            seen.setdefault(name, []).append((unique, counts))
        count += 1
    if count == 0:
        raise ValueError("profile(): the DataModule's train_dataloader() yielded no batches.")
    features = {}
    for name, parts in seen.items():
        unique, inverse = torch.unique(torch.cat([u for u, _ in parts]), return_inverse=True)
        merged = torch.zeros(unique.numel(), dtype=torch.int64).index_add_(0, inverse, torch.cat([c for _, c in parts]))
        features[name] = FeatureProfile(examples=examples, ids=ids_per_feature[name], unique_ids=unique, counts=merged)
    return LoadProfile(batches=count, examples=examples, features=features)


def resolve_table_stats(
    tables: Sequence[BaseEmbeddingConfig],
    stats: Mapping[str, TableStats] | LoadProfile | None,
    pooling_factor_defaults: Mapping[str, float] | None = None,
) -> tuple[dict[str, TableStats], set[str]]:
    """Stats for every table, and the names whose stats are assumed (no observation was given).

    Missing tables get ``pooling_factor_defaults[name]`` (e.g. from ``TableConstraints``) or
    TorchRec's default of 1.0 id per feature, spread evenly over the rows.
    """
    names = {t.name for t in tables}
    if isinstance(stats, LoadProfile):
        resolved = stats.table_stats(tables)
    else:
        resolved = dict(stats or {})
        unknown = sorted(set(resolved) - names)
        if unknown:
            raise ValueError(f"stats names tables the model does not have: {unknown}; the model's tables are {sorted(names)}.")
        for name, value in resolved.items():
            if not isinstance(value, TableStats):
                raise TypeError(f"stats[{name!r}] must be a TableStats, got {type(value).__name__}.")
    assumed: set[str] = set()
    defaults = pooling_factor_defaults or {}
    for table in tables:
        if table.name not in resolved:
            assumed.add(table.name)
            resolved[table.name] = TableStats(pooling_factor=float(defaults.get(table.name, 1.0)), features=len(table.feature_names))
    return resolved, assumed

"""Synthetic click logs with Zipf-skewed multi-hot ids and a planted, learnable signal."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset
from torchrec import KeyedJaggedTensor

from lightning_recsys.data.batch import RecBatch, sparse_feature_names
from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.ranks import even_rank_range

_SPLIT_IDS: dict[str, int] = {"train": 0, "val": 1, "test": 2}
# One source for the default of both the config and the DataModule's argument (never mutated: both copy it).
DEFAULT_TABLE_SIZES: list[int] = [1000] * 8


@dataclass(kw_only=True)
class SyntheticClickLogConfig:
    """Shape and statistics of the synthetic click log: the validated record of ``SyntheticClickLogDataModule``'s
    arguments, which ``SyntheticClickLog`` generates from.

    Args:
        table_sizes: rows of each sparse feature's table; one feature per entry.
        num_dense_features: dense features per example.
        pooling_factors: mean ids per example for each feature (one value for all features, or one
            per feature); lengths are uniform on ``[1, 2 * mean - 1]``.
        zipf_exponent: skew of the id distribution (rank ``k`` has probability ``∝ 1 / k**s``).
        global_batch_size: examples per step across all ranks; each rank gets an equal slice.
        train_batches, val_batches, test_batches: global batches per epoch of each split.
        signal_strength: standard deviation of the planted logit; larger is easier to learn.
        base_logit: the logit's offset, which sets the click-through rate (-1.0 gives ~30%).
        seed: everything, including the planted signal, is a function of the seed.
    """

    table_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_TABLE_SIZES))
    num_dense_features: int = 13
    pooling_factors: list[float] | float = 2.0
    zipf_exponent: float = 1.05
    global_batch_size: int = 512
    train_batches: int = 200
    val_batches: int = 20
    test_batches: int = 20
    signal_strength: float = 2.5
    base_logit: float = -1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.table_sizes or any(size < 1 for size in self.table_sizes):
            raise ValueError(f"table_sizes={self.table_sizes} must be a non-empty list of positive row counts.")
        if self.num_dense_features < 0:
            raise ValueError(f"num_dense_features={self.num_dense_features} must be >= 0.")
        factors = self.feature_pooling_factors()
        if len(factors) != len(self.table_sizes):
            raise ValueError(
                f"pooling_factors has {len(factors)} entries but table_sizes has {len(self.table_sizes)}; "
                "give one value, or one per table."
            )
        if any(f < 1 for f in factors):
            raise ValueError(f"pooling_factors={self.pooling_factors} must all be >= 1.")
        if self.zipf_exponent < 0:
            raise ValueError(f"zipf_exponent={self.zipf_exponent} must be >= 0 (0 is uniform).")
        if self.global_batch_size < 1:
            raise ValueError(f"global_batch_size={self.global_batch_size} must be >= 1.")
        for name in ("train_batches", "val_batches", "test_batches"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0.")

    @property
    def feature_names(self) -> list[str]:
        return sparse_feature_names(len(self.table_sizes))

    def feature_pooling_factors(self) -> list[float]:
        if isinstance(self.pooling_factors, (int, float)):
            return [float(self.pooling_factors)] * len(self.table_sizes)
        return [float(f) for f in self.pooling_factors]


class SyntheticClickLog:
    """Deterministic generator of global batches: batch ``i`` of a split depends only on the config."""

    def __init__(self, config: SyntheticClickLogConfig) -> None:
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        self._cdfs: list[torch.Tensor] = []
        self._row_of_rank: list[torch.Tensor] = []  # hot ids land on scattered rows, as after hashing
        self._affinity: list[torch.Tensor] = []  # the planted per-row effect
        for size in config.table_sizes:
            weights = 1.0 / torch.arange(1, size + 1, dtype=torch.float64) ** config.zipf_exponent
            self._cdfs.append(torch.cumsum(weights / weights.sum(), 0))
            self._row_of_rank.append(torch.randperm(size, generator=gen))
            self._affinity.append(torch.randn(size, generator=gen))
        self._dense_weights = torch.randn(config.num_dense_features, generator=gen)

    def global_batch(self, split: Split, index: int) -> RecBatch:
        cfg = self.config
        gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + _SPLIT_IDS[split]) * 1_000_003 + index)
        batch = cfg.global_batch_size
        dense = torch.randn(batch, cfg.num_dense_features, generator=gen)
        lengths, values, sparse_logit = [], [], torch.zeros(batch)
        for table, mean in enumerate(cfg.feature_pooling_factors()):
            max_len = max(1, int(round(2 * mean - 1)))
            feature_lengths = torch.randint(1, max_len + 1, (batch,), generator=gen)
            u = torch.rand(batch, max_len, generator=gen, dtype=torch.float64)
            ranks = torch.searchsorted(self._cdfs[table], u).clamp_(max=cfg.table_sizes[table] - 1)
            ids = self._row_of_rank[table][ranks]
            valid = torch.arange(max_len) < feature_lengths[:, None]
            sparse_logit += (self._affinity[table][ids] * valid).sum(1) / feature_lengths
            lengths.append(feature_lengths)
            values.append(ids[valid])
        num_features = len(cfg.table_sizes)
        logit = cfg.signal_strength * (
            sparse_logit / math.sqrt(num_features) * math.sqrt(0.75)
            + (dense @ self._dense_weights) / math.sqrt(max(cfg.num_dense_features, 1)) * math.sqrt(0.25)
        )
        labels = torch.bernoulli(torch.sigmoid(logit + cfg.base_logit), generator=gen)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=cfg.feature_names, values=torch.cat(values), lengths=torch.cat(lengths)
        )
        return RecBatch(dense=dense, sparse=sparse, labels=labels)


def slice_batch(batch: RecBatch, start: int, stop: int) -> RecBatch:
    """Examples ``[start, stop)`` of a batch (features keep their order)."""
    kjt = batch.sparse
    lengths = kjt.lengths().view(len(kjt.keys()), -1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(kjt.lengths(), 0)])
    pieces = [slice(int(offsets[f * lengths.shape[1] + start]), int(offsets[f * lengths.shape[1] + stop])) for f in range(len(kjt.keys()))]
    weights = kjt.weights_or_none()  # a weighted feature's weights go with its ids
    sparse = KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(),
        values=torch.cat([kjt.values()[p] for p in pieces]),
        lengths=lengths[:, start:stop].reshape(-1),
        weights=None if weights is None else torch.cat([weights[p] for p in pieces]),
    )
    return RecBatch(dense=batch.dense[start:stop], sparse=sparse, labels=batch.labels[start:stop])


class GlobalBatchLog(Protocol):
    """A generator of global batches by index (``SyntheticClickLog``, ``SyntheticSequenceLog``)."""

    config: Any  # has ``global_batch_size``

    def global_batch(self, split: Split, index: int) -> RecBatch: ...


class SyntheticClickLogDataset(IterableDataset):
    """The ``rank``-th slice of every global batch of a split."""

    def __init__(self, log: GlobalBatchLog, split: Split, num_batches: int, rank: int, world_size: int) -> None:
        self.log, self.split, self.num_batches = log, split, num_batches
        self.start, self.stop = even_rank_range(log.config.global_batch_size, rank, world_size)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[RecBatch]:
        for index in range(self.num_batches):
            yield slice_batch(self.log.global_batch(self.split, index), self.start, self.stop)


def config_from_arguments(owner: str, config_class: type, args: tuple[Any, ...], keywords: dict[str, Any], fields: dict[str, Any]) -> Any:
    """The validated config of a DataModule's keyword ``fields``; a positional argument, ``config=`` or an
    unknown keyword raises ``TypeError``.

    ``owner`` once took one config dataclass; it now takes the config's fields as keyword arguments,
    as every other DataModule does (so a YAML writes them under ``data.init_args``). ``*args`` and
    ``**kwargs`` catch the old calls to say so, rather than Python's bare "unexpected argument".
    """
    new_way = (
        f"pass its fields as keyword arguments: {owner}(global_batch_size=..., train_batches=..., ...), or "
        f"{owner}.from_config(config) with a {config_class.__name__} at hand; in YAML, under data.init_args directly"
    )
    if "config" in keywords:
        raise TypeError(f"{owner} no longer takes config=; {new_way}.")
    if keywords:
        raise TypeError(f"{owner}() got an unexpected keyword argument {next(iter(keywords))!r}")
    if args:
        given = f"a {config_class.__name__}" if isinstance(args[0], config_class) else f"{len(args)} positional argument(s)"
        raise TypeError(f"{owner} takes keyword arguments only, got {given}; {new_way}.")
    return config_class(**fields)  # validates: each error names the argument, its value and the rule


class SyntheticClickLogDataModule(RankSlicedDataModule):
    """Synthetic click logs for any ranker; every rank gets its own slice of each global batch.

    The data does not depend on the number of ranks: global batch ``i`` is the same on 1 or 64
    ranks, so runs on different world sizes are comparable. The arguments are validated into
    ``self.config`` (a ``SyntheticClickLogConfig``) at construction; ``from_config`` takes one as is.

    Args:
        table_sizes: rows of each sparse feature's table; one feature per entry.
        num_dense_features: dense features per example.
        pooling_factors: mean ids per example for each feature (one value for all features, or one
            per feature); lengths are uniform on ``[1, 2 * mean - 1]``.
        zipf_exponent: skew of the id distribution (rank ``k`` has probability ``∝ 1 / k**s``).
        global_batch_size: examples per step across all ranks; each rank gets an equal slice.
        train_batches: global batches per training epoch.
        val_batches: global batches of the validation split.
        test_batches: global batches of the test split (also used for predict).
        signal_strength: standard deviation of the planted logit; larger is easier to learn.
        base_logit: the logit's offset, which sets the click-through rate (-1.0 gives ~30%).
        seed: everything, including the planted signal, is a function of the seed.
    """

    def __init__(
        self,
        *removed: Any,  # the old positional config: a TypeError naming the keyword arguments
        table_sizes: list[int] = DEFAULT_TABLE_SIZES,
        num_dense_features: int = SyntheticClickLogConfig.num_dense_features,
        pooling_factors: list[float] | float = SyntheticClickLogConfig.pooling_factors,
        zipf_exponent: float = SyntheticClickLogConfig.zipf_exponent,
        global_batch_size: int = SyntheticClickLogConfig.global_batch_size,
        train_batches: int = SyntheticClickLogConfig.train_batches,
        val_batches: int = SyntheticClickLogConfig.val_batches,
        test_batches: int = SyntheticClickLogConfig.test_batches,
        signal_strength: float = SyntheticClickLogConfig.signal_strength,
        base_logit: float = SyntheticClickLogConfig.base_logit,
        seed: int = SyntheticClickLogConfig.seed,
        **removed_keywords: Any,  # config= raises a TypeError naming the keyword arguments
    ) -> None:
        super().__init__()
        self.config: SyntheticClickLogConfig = config_from_arguments(
            type(self).__name__, SyntheticClickLogConfig, removed, removed_keywords, dict(
                table_sizes=list(table_sizes), num_dense_features=num_dense_features,
                pooling_factors=list(pooling_factors) if isinstance(pooling_factors, list) else pooling_factors,
                zipf_exponent=zipf_exponent, global_batch_size=global_batch_size, train_batches=train_batches,
                val_batches=val_batches, test_batches=test_batches, signal_strength=signal_strength,
                base_logit=base_logit, seed=seed,
            ),
        )
        self.log = SyntheticClickLog(self.config)

    @classmethod
    def from_config(cls, config: SyntheticClickLogConfig) -> SyntheticClickLogDataModule:
        """The DataModule of a config at hand (its fields as the keyword arguments)."""
        return cls(**dataclasses.asdict(config))

    def _dataset(self, split: Split, rank: int, world_size: int) -> SyntheticClickLogDataset:
        num_batches = {"train": self.config.train_batches, "val": self.config.val_batches, "test": self.config.test_batches}[split]
        return SyntheticClickLogDataset(self.log, split, num_batches, rank, world_size)

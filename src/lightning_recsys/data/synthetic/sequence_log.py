"""Synthetic user histories with Zipf-skewed item ids and a planted signal that only the history reveals.

Every example is a user's history (item ids and action types, oldest first, newest last), one
candidate item, a few pooled context ids and dense features, and a click label. How it is drawn:

- Items fall into ``num_clusters`` latent clusters of ``num_items / num_clusters`` items each. An
  item is drawn as a uniform cluster, then a within-cluster rank ``r`` with probability
  ``∝ 1 / r**zipf_exponent`` (the hot-id knob: the ``num_clusters`` items of rank 1 are the
  hottest). Items land on scattered rows of the item table, as after hashing.
- Each user has ``interests_per_user`` interest clusters. The history's items come from every
  cluster alike; a history item in an interest cluster gets a positive action (types
  ``1 .. num_action_types - 1``) with probability ``positive_rate_in_interest``, any other one with
  ``positive_rate_outside``; otherwise action 0 (seen, not acted on).
- The candidate is drawn like a history item, independently of the user. ``match`` is the share of
  the user's newest ``recent_positives`` positive actions whose cluster is the candidate's
  (``1 / num_clusters`` when the history has no positive action). The click logit is
  ``base_logit + history_signal * match + context_signal * c``, where ``c`` (about unit variance)
  comes from planted per-row effects of the context ids and planted weights of the dense features.

Why a pooled model without the history cannot find ``history_signal``: the label depends on the
candidate only through its cluster, and every cluster is alike (uniform cluster draws, the same
within-cluster ranks, uniform interests), so every candidate item has the same click rate. The
history's item ids alone say little (they come from every cluster alike, whatever the interests):
which items got a positive action, and how recently, is what reveals them.

Batch (``RecBatch``), KJT keys in this order:

- ``history_item_id``: jagged, ``min_history_length .. max_history_length`` ids per example, rows of
  the item table (``num_items`` rows), oldest first, newest last;
- ``history_action``: jagged, the same lengths, action types ``0 .. num_action_types - 1``;
- ``candidate_item_id``: one id per example, same item table;
- ``context_0 .. context_{n-1}``: one id per example each, Zipf over its own table
  (``context_table_sizes``).

Dense features ``[B, num_dense_features]``: standard normal. Labels ``[B]``: 0.0 or 1.0.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec import KeyedJaggedTensor

from lightning_recsys.contracts.names import CANDIDATE_ITEM_FEATURE, HISTORY_ACTION_FEATURE, HISTORY_ITEM_FEATURE
from lightning_recsys.data.batch import RecBatch
from lightning_recsys.data.history_shape import SequenceDataShape
from lightning_recsys.data.module import RankSlicedDataModule, Split
from lightning_recsys.data.synthetic.click_log import SyntheticClickLogDataset, config_from_arguments

_SPLIT_IDS: dict[str, int] = {"train": 0, "val": 1, "test": 2}
# One source for the default of both the config and the DataModule's argument (never mutated: both copy it).
DEFAULT_CONTEXT_TABLE_SIZES: list[int] = [100, 24]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}.")


def _check_probability(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} must be a probability in [0, 1].")


@dataclass(kw_only=True)
class SyntheticSequenceConfig:
    """Shape and statistics of the synthetic histories (see the module docstring for how they are drawn): the
    validated record of ``SyntheticSequenceDataModule``'s arguments, which ``SyntheticSequenceLog`` generates from.

    Args:
        num_items: rows of the item table (history and candidate share it); a multiple of
            ``num_clusters``.
        num_clusters: latent item clusters.
        zipf_exponent: skew of the within-cluster rank (rank ``r`` has probability ``∝ 1 / r**s``);
            0 is uniform. The hot-id knob.
        min_history_length, max_history_length: history lengths are uniform on this range
            (inclusive); ``max_history_length`` is the longest history emitted.
        num_action_types: action types; 0 is "seen, no action", ``1 ..`` are positive actions.
        interests_per_user: interest clusters per user (distinct, uniform).
        positive_rate_in_interest, positive_rate_outside: probability of a positive action on a
            history item in / outside the user's interest clusters.
        recent_positives: how many of the newest positive actions the label looks at.
        history_signal: the click logit's gain from ``match`` (0 plants no history signal).
        context_table_sizes: rows of each pooled context feature's table (``context_0``, ...).
        num_dense_features: dense features per example.
        context_signal: scale of the logit the context ids and dense features plant (0: none).
        base_logit: the logit's offset, which sets the click-through rate.
        global_batch_size: examples per step across all ranks; each rank gets an equal slice.
        train_batches, val_batches, test_batches: global batches per epoch of each split.
        seed: everything, including the clusters and the planted effects, is a function of the seed.
        emit_history: ``False`` leaves ``history_item_id`` and ``history_action`` out of the batches
            (the same examples and labels otherwise): the input of a pooled model without the history.
    """

    num_items: int = 2000
    num_clusters: int = 8
    zipf_exponent: float = 1.05
    min_history_length: int = 0
    max_history_length: int = 50
    num_action_types: int = 3
    interests_per_user: int = 1
    positive_rate_in_interest: float = 0.7
    positive_rate_outside: float = 0.05
    recent_positives: int = 5
    history_signal: float = 5.0
    context_table_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_CONTEXT_TABLE_SIZES))
    num_dense_features: int = 4
    context_signal: float = 1.0
    base_logit: float = -2.0
    global_batch_size: int = 512
    train_batches: int = 100
    val_batches: int = 10
    test_batches: int = 10
    seed: int = 0
    emit_history: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.emit_history, bool):
            raise ValueError(f"emit_history={self.emit_history!r} must be true or false.")
        _check_int("num_clusters", self.num_clusters, 1)
        _check_int("num_items", self.num_items, self.num_clusters)
        if self.num_items % self.num_clusters:
            raise ValueError(
                f"num_items={self.num_items} must be a multiple of num_clusters={self.num_clusters} (equal clusters keep "
                f"every candidate's click rate alike); use e.g. {self.num_items // self.num_clusters * self.num_clusters}."
            )
        if not self.zipf_exponent >= 0:
            raise ValueError(f"zipf_exponent={self.zipf_exponent} must be >= 0 (0 is uniform).")
        _check_int("min_history_length", self.min_history_length, 0)
        _check_int("max_history_length", self.max_history_length, max(self.min_history_length, 1))
        _check_int("num_action_types", self.num_action_types, 2)
        _check_int("interests_per_user", self.interests_per_user, 1)
        if self.interests_per_user > self.num_clusters:
            raise ValueError(f"interests_per_user={self.interests_per_user} must be <= num_clusters={self.num_clusters}.")
        _check_probability("positive_rate_in_interest", self.positive_rate_in_interest)
        _check_probability("positive_rate_outside", self.positive_rate_outside)
        _check_int("recent_positives", self.recent_positives, 1)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.context_table_sizes):
            raise ValueError(f"context_table_sizes={self.context_table_sizes} must all be integers >= 1 (rows per table).")
        _check_int("num_dense_features", self.num_dense_features, 0)
        _check_int("global_batch_size", self.global_batch_size, 1)
        for name in ("train_batches", "val_batches", "test_batches", "seed"):
            _check_int(name, getattr(self, name), 0)

    @property
    def context_feature_names(self) -> list[str]:
        return [f"context_{i}" for i in range(len(self.context_table_sizes))]

    @property
    def feature_names(self) -> list[str]:
        """Every KJT key, in batch order."""
        history = [HISTORY_ITEM_FEATURE, HISTORY_ACTION_FEATURE] if self.emit_history else []
        return [*history, CANDIDATE_ITEM_FEATURE, *self.context_feature_names]


def _zipf_cdf(size: int, exponent: float) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, size + 1, dtype=torch.float64) ** exponent
    return torch.cumsum(weights / weights.sum(), 0)


class SyntheticSequenceLog:
    """Deterministic generator of global batches: batch ``i`` of a split depends only on the config."""

    def __init__(self, config: SyntheticSequenceConfig) -> None:
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        self._rank_cdf = _zipf_cdf(config.num_items // config.num_clusters, config.zipf_exponent)
        # Item ``cluster + num_clusters * rank`` lands on row ``item_row[item]``; ``cluster_of_row`` inverts it.
        self.item_row = torch.randperm(config.num_items, generator=gen)
        self.cluster_of_row = torch.empty(config.num_items, dtype=torch.long)
        self.cluster_of_row[self.item_row] = torch.arange(config.num_items) % config.num_clusters
        self._context_cdfs = [_zipf_cdf(size, config.zipf_exponent) for size in config.context_table_sizes]
        self.context_effects = [torch.randn(size, generator=gen) for size in config.context_table_sizes]
        self.dense_weights = torch.randn(config.num_dense_features, generator=gen)

    def _items(self, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        """Rows of items drawn as a uniform cluster and a Zipf rank within it."""
        cfg = self.config
        clusters = torch.randint(0, cfg.num_clusters, shape, generator=gen)
        u = torch.rand(shape, generator=gen, dtype=torch.float64)
        ranks = torch.searchsorted(self._rank_cdf, u).clamp_(max=len(self._rank_cdf) - 1)
        return self.item_row[clusters + cfg.num_clusters * ranks]

    def match(self, history_rows: torch.Tensor, actions: torch.Tensor, valid: torch.Tensor, candidate_rows: torch.Tensor) -> torch.Tensor:
        """The planted history feature: the share of the newest ``recent_positives`` positive actions
        (of padded ``[B, L]`` histories, oldest first) in the candidate's cluster."""
        cfg = self.config
        positive = (actions > 0) & valid
        positives_at_or_after = positive.flip(1).cumsum(1).flip(1)
        recent = positive & (positives_at_or_after <= cfg.recent_positives)
        same = self.cluster_of_row[history_rows] == self.cluster_of_row[candidate_rows][:, None]
        count = recent.sum(1)
        share = (recent & same).sum(1) / count.clamp(min=1)
        return torch.where(count > 0, share, torch.full_like(share, 1.0 / cfg.num_clusters))

    def global_batch(self, split: Split, index: int) -> RecBatch:
        cfg = self.config
        gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + _SPLIT_IDS[split]) * 1_000_003 + index)
        batch, width = cfg.global_batch_size, cfg.max_history_length
        lengths = torch.randint(cfg.min_history_length, cfg.max_history_length + 1, (batch,), generator=gen)
        valid = torch.arange(width) < lengths[:, None]
        history = self._items((batch, width), gen)
        interests = torch.rand(batch, cfg.num_clusters, generator=gen).argsort(1)[:, : cfg.interests_per_user]
        in_interest = (self.cluster_of_row[history][:, :, None] == interests[:, None, :]).any(2)
        rate = torch.where(in_interest, cfg.positive_rate_in_interest, cfg.positive_rate_outside)
        positive = torch.rand(batch, width, generator=gen) < rate
        kinds = torch.randint(1, cfg.num_action_types, (batch, width), generator=gen)
        actions = torch.where(positive, kinds, torch.zeros_like(kinds))
        candidate = self._items((batch,), gen)
        context = [
            torch.searchsorted(cdf, torch.rand(batch, generator=gen, dtype=torch.float64)).clamp_(max=len(cdf) - 1)
            for cdf in self._context_cdfs
        ]
        dense = torch.randn(batch, cfg.num_dense_features, generator=gen)
        logit = cfg.base_logit + cfg.history_signal * self.match(history, actions, valid, candidate)
        logit = logit + cfg.context_signal * self.context_logit(context, dense)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        ones = torch.ones(batch, dtype=torch.long)
        values, feature_lengths = [candidate, *context], [ones] * (1 + len(context))
        if cfg.emit_history:
            values, feature_lengths = [history[valid], actions[valid], *values], [lengths, lengths, *feature_lengths]
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=cfg.feature_names, values=torch.cat(values), lengths=torch.cat(feature_lengths))
        return RecBatch(dense=dense, sparse=sparse, labels=labels)

    def planted_logit(self, batch: RecBatch) -> torch.Tensor:
        """The logit a batch's labels were drawn from (the best any model can do), from the batch itself."""
        kjt, cfg = batch.sparse, self.config
        items, actions = kjt[HISTORY_ITEM_FEATURE], kjt[HISTORY_ACTION_FEATURE]
        width = cfg.max_history_length
        valid = torch.arange(width) < items.lengths()[:, None]
        history, acts = items.to_padded_dense(width, padding_value=0), actions.to_padded_dense(width, padding_value=0)
        match = self.match(history, acts, valid, kjt[CANDIDATE_ITEM_FEATURE].values())
        context = self.context_logit([kjt[name].values() for name in cfg.context_feature_names], batch.dense)
        return cfg.base_logit + cfg.history_signal * match + cfg.context_signal * context

    def context_logit(self, context: list[torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        """The planted non-history logit, about unit variance: context-id effects and dense weights, half each."""
        parts = []
        if context:
            parts.append(sum(effects[ids] for effects, ids in zip(self.context_effects, context)) / math.sqrt(len(context)))
        if dense.shape[1]:
            parts.append(dense @ self.dense_weights / math.sqrt(dense.shape[1]))
        if not parts:
            return torch.zeros(dense.shape[0])
        return sum(parts) / math.sqrt(len(parts))


class SyntheticSequenceDataModule(SequenceDataShape, RankSlicedDataModule):
    """Synthetic histories for a sequence ranker; every rank gets its own slice of each global batch.

    As ``SyntheticClickLogDataModule``, global batch ``i`` is the same on any number of ranks. The
    arguments are validated into ``self.config`` (a ``SyntheticSequenceConfig``) at construction;
    ``from_config`` takes one as is. The attributes ``item_table_size``, ``num_action_types``,
    ``context_feature_names``, ``context_table_sizes``, ``num_dense_features`` and
    ``max_history_length`` describe the batches.

    Args:
        num_items: rows of the item table (history and candidate share it); a multiple of
            ``num_clusters``.
        num_clusters: latent item clusters.
        zipf_exponent: skew of the within-cluster rank (rank ``r`` has probability ``∝ 1 / r**s``)
            and of the context ids; 0 is uniform. The hot-id knob.
        min_history_length: the shortest history (lengths are uniform up to ``max_history_length``).
        max_history_length: the longest history emitted.
        num_action_types: action types; 0 is "seen, no action", ``1 ..`` are positive actions.
        interests_per_user: interest clusters per user (distinct, uniform).
        positive_rate_in_interest: probability of a positive action on a history item in the user's
            interest clusters.
        positive_rate_outside: the same outside them.
        recent_positives: how many of the newest positive actions the label looks at.
        history_signal: the click logit's gain from the history match (0 plants no history signal).
        context_table_sizes: rows of each pooled context feature's table (``context_0``, ...).
        num_dense_features: dense features per example.
        context_signal: scale of the logit the context ids and dense features plant (0: none).
        base_logit: the logit's offset, which sets the click-through rate.
        global_batch_size: examples per step across all ranks; each rank gets an equal slice.
        train_batches: global batches per training epoch.
        val_batches: global batches of the validation split.
        test_batches: global batches of the test split.
        seed: everything, including the clusters and the planted effects, is a function of the seed.
        emit_history: ``False`` leaves ``history_item_id`` and ``history_action`` out of the batches
            (the same examples and labels otherwise): the input of a pooled model without the history.
    """

    def __init__(
        self,
        *removed: Any,  # the old positional config: a TypeError naming the keyword arguments
        num_items: int = SyntheticSequenceConfig.num_items,
        num_clusters: int = SyntheticSequenceConfig.num_clusters,
        zipf_exponent: float = SyntheticSequenceConfig.zipf_exponent,
        min_history_length: int = SyntheticSequenceConfig.min_history_length,
        max_history_length: int = SyntheticSequenceConfig.max_history_length,
        num_action_types: int = SyntheticSequenceConfig.num_action_types,
        interests_per_user: int = SyntheticSequenceConfig.interests_per_user,
        positive_rate_in_interest: float = SyntheticSequenceConfig.positive_rate_in_interest,
        positive_rate_outside: float = SyntheticSequenceConfig.positive_rate_outside,
        recent_positives: int = SyntheticSequenceConfig.recent_positives,
        history_signal: float = SyntheticSequenceConfig.history_signal,
        context_table_sizes: list[int] = DEFAULT_CONTEXT_TABLE_SIZES,
        num_dense_features: int = SyntheticSequenceConfig.num_dense_features,
        context_signal: float = SyntheticSequenceConfig.context_signal,
        base_logit: float = SyntheticSequenceConfig.base_logit,
        global_batch_size: int = SyntheticSequenceConfig.global_batch_size,
        train_batches: int = SyntheticSequenceConfig.train_batches,
        val_batches: int = SyntheticSequenceConfig.val_batches,
        test_batches: int = SyntheticSequenceConfig.test_batches,
        seed: int = SyntheticSequenceConfig.seed,
        emit_history: bool = SyntheticSequenceConfig.emit_history,
        **removed_keywords: Any,  # config= raises a TypeError naming the keyword arguments
    ) -> None:
        super().__init__()
        self.config: SyntheticSequenceConfig = config_from_arguments(
            type(self).__name__, SyntheticSequenceConfig, removed, removed_keywords, dict(
                num_items=num_items, num_clusters=num_clusters, zipf_exponent=zipf_exponent,
                min_history_length=min_history_length, max_history_length=max_history_length,
                num_action_types=num_action_types, interests_per_user=interests_per_user,
                positive_rate_in_interest=positive_rate_in_interest, positive_rate_outside=positive_rate_outside,
                recent_positives=recent_positives, history_signal=history_signal,
                context_table_sizes=list(context_table_sizes), num_dense_features=num_dense_features,
                context_signal=context_signal, base_logit=base_logit, global_batch_size=global_batch_size,
                train_batches=train_batches, val_batches=val_batches, test_batches=test_batches, seed=seed,
                emit_history=emit_history,
            ),
        )
        self.log = SyntheticSequenceLog(self.config)

    @classmethod
    def from_config(cls, config: SyntheticSequenceConfig) -> SyntheticSequenceDataModule:
        """The DataModule of a config at hand (its fields as the keyword arguments)."""
        return cls(**dataclasses.asdict(config))

    def _dataset(self, split: Split, rank: int, world_size: int) -> SyntheticClickLogDataset:
        num_batches = {"train": self.config.train_batches, "val": self.config.val_batches, "test": self.config.test_batches}[split]
        return SyntheticClickLogDataset(self.log, split, num_batches, rank, world_size)

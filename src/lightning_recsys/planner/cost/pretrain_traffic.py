"""The pretraining workload's traffic (``SequencePretrainer``): history tokens, targets and negatives through one table.

Trainer-free (no Lightning imports). ``SequencePretrainer`` reads one item table with three features, so
they share one sequence all-to-all (forward embeddings, backward gradients), and index dedup removes
repeats across all three (``torchrec/distributed/embedding.py``, ``_dedup_indices``: one id range per table).
Per rank and step, with ``b`` examples of ``T`` input tokens on average (``tokens_per_example``, the
inputs after the ``max_length`` cut) and a pool of ``K`` negatives (``num_negatives``; shared by the
rank's batch as ``SequencePretrainDataModule`` draws it, or ``K`` per example):

* without dedup: ``item_id`` ``bT`` ids, ``next_item_id`` ``bT``, ``negative_item_id`` ``K`` (or ``bK``);
* with dedup, filed as the accounting files them (``parallel/comms/lookup_traffic.py``: an id under the first
  feature that holds it): ``item_id`` ``D(N, s, bT)``; ``next_item_id`` only the targets that are not inputs,
  each example's last one, ``D(N, s, b(T+1)) - D(N, s, bT)``; ``negative_item_id`` the distinct negatives not
  among those, ``D(N, 0, K) (1 - D(N, s, b(T+1)) / N)`` for uniform negatives (independent of the history),
  ``D(N, s, b(T+1) + K) - D(N, s, b(T+1))`` for negatives drawn by popularity. ``D`` is the expected distinct
  rows of i.i.d. Zipf draws (``traffic_model.expected_distinct``); hot items repeat within a batch, uniform
  negatives over a large table rarely do.

``from_batches`` learns ``T``, ``K`` and the Zipf exponent ``s`` from sampled batches: ``s`` is the one under
which the batches' history ids are expected to have as many distinct rows as they have
(``zipf_exponent_for_distinct``), so a real dataset's repeats are matched at its batch size, not assumed.

The full-ranking evaluation (``parallel/ranking``) runs per evaluation batch inside the sharding group:
``ranking_eval_traffic``. In 2D the group is a node, so the evaluation sends nothing across nodes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from lightning_recsys.contracts.names import SEQUENCE_ITEM_FEATURES
from lightning_recsys.planner.cost.cost_model import Collective
from lightning_recsys.planner.cost.traffic_model import Feature, ModelShape, expected_distinct, zipf_exponent_for_distinct

HISTORY, TARGETS, NEGATIVES = SEQUENCE_ITEM_FEATURES  # SequencePretrainer's features of the item table
NegativeSampling = Literal["uniform", "popularity"]


@dataclass(frozen=True, kw_only=True)
class PretrainItemFeature(Feature):
    """The item table of a pretrainer as one ``Feature``: inputs, targets and a pool of negatives (module docstring).

    Build it with ``PretrainWorkload.item_feature()``; ``ids_per_example`` is ``2T + K/b`` (``K b / b`` per example).
    """

    tokens_per_example: float
    batch_per_rank: int
    num_negatives: int
    shared_negatives: bool = True
    negative_sampling: NegativeSampling = "uniform"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pooled:
            raise ValueError(f"PretrainItemFeature({self.name!r}) is a sequence feature: pooled must be False.")
        if self.negative_sampling not in ("uniform", "popularity"):
            raise ValueError(f"negative_sampling={self.negative_sampling!r} must be 'uniform' or 'popularity'.")

    def negative_draws(self, batches: float) -> float:
        return batches * self.num_negatives * (1 if self.shared_negatives else self.batch_per_rank)

    def parts_per_rank(self, batch_per_rank: int, *, index_dedup: bool) -> dict[str, float]:
        """Expected ids of each feature one rank sends per step (module docstring)."""
        tokens = batch_per_rank * self.tokens_per_example
        negatives = self.negative_draws(batch_per_rank / self.batch_per_rank)
        if not index_dedup:
            return {HISTORY: tokens, TARGETS: tokens, NEGATIVES: negatives}
        history = self._distinct(tokens)
        with_targets = self._distinct(tokens + batch_per_rank)
        new_negatives = self._new_negatives(with_targets, tokens + batch_per_rank, negatives)
        return {HISTORY: history, TARGETS: with_targets - history, NEGATIVES: new_negatives}

    def sent_ids(self, batch_per_rank: int, *, index_dedup: bool) -> float:
        return sum(self.parts_per_rank(batch_per_rank, index_dedup=index_dedup).values())

    def distinct(self, draws: float) -> float:
        """Rows touched by ``draws / ids_per_example`` examples (their inputs, targets and negatives): a sync's union."""
        if self.touched_fraction is not None:
            return self.touched_fraction * self.rows
        examples = draws / self.ids_per_example
        seen = examples * (self.tokens_per_example + 1)
        with_targets = self._distinct(seen)
        return with_targets + self._new_negatives(with_targets, seen, self.negative_draws(examples / self.batch_per_rank))

    def _distinct(self, draws: float) -> float:
        return expected_distinct(self.rows, draws, self.zipf_exponent)

    def _new_negatives(self, touched: float, touched_draws: float, negatives: float) -> float:
        if self.negative_sampling == "popularity":  # the same law as the history: the union of both draws
            return self._distinct(touched_draws + negatives) - touched
        return expected_distinct(self.rows, negatives, 0.0) * (1 - touched / self.rows)


@dataclass(frozen=True, kw_only=True)
class PretrainWorkload:
    """What one rank of a ``SequencePretrainer`` run looks up per step; ``from_batches`` learns it from data."""

    items: int
    dim: int
    batch_per_rank: int
    tokens_per_example: float
    num_negatives: int
    shared_negatives: bool = True
    negative_sampling: NegativeSampling = "uniform"
    zipf_exponent: float = 1.0
    action_types: int = 0
    seen_per_example: float | None = None  # evaluation: seen ids per user (default: tokens_per_example)

    def __post_init__(self) -> None:
        for name in ("items", "dim", "batch_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PretrainWorkload.{name}={value!r} must be an integer >= 1.")
        if isinstance(self.num_negatives, bool) or not isinstance(self.num_negatives, int) or self.num_negatives < 0:
            raise ValueError(f"PretrainWorkload.num_negatives={self.num_negatives!r} must be an integer >= 0.")
        if not self.tokens_per_example > 0 or not math.isfinite(self.tokens_per_example):
            raise ValueError(f"PretrainWorkload.tokens_per_example={self.tokens_per_example!r} must be a finite number > 0.")

    @property
    def negatives_per_example(self) -> float:
        return self.num_negatives / self.batch_per_rank if self.shared_negatives else float(self.num_negatives)

    def item_feature(self) -> PretrainItemFeature:
        return PretrainItemFeature(
            name="item", rows=self.items, dim=self.dim, pooled=False, zipf_exponent=self.zipf_exponent,
            ids_per_example=2 * self.tokens_per_example + self.negatives_per_example, tokens_per_example=self.tokens_per_example,
            batch_per_rank=self.batch_per_rank, num_negatives=self.num_negatives, shared_negatives=self.shared_negatives,
            negative_sampling=self.negative_sampling,
        )  # fmt: skip

    def ids_per_rank(self, *, index_dedup: bool) -> dict[str, float]:
        """Expected ids of each item feature one rank sends through the all-to-all per step."""
        return self.item_feature().parts_per_rank(self.batch_per_rank, index_dedup=index_dedup)

    def model_shape(self, *, dense_param_bytes: float, name: str = "pretraining", compute_s: float | None = None,
                    optimizer_state_per_row: float = 1.0) -> ModelShape:  # fmt: skip
        """The workload as the traffic model's ``ModelShape`` (the item table, and the action table if any)."""
        features: tuple[Feature, ...] = (self.item_feature(),)
        if self.action_types:
            features += (Feature(name="action", rows=self.action_types, dim=self.dim, ids_per_example=self.tokens_per_example,
                                 pooled=False, zipf_exponent=0.0),)  # fmt: skip
        return ModelShape(name=name, batch_per_rank=self.batch_per_rank, features=features, dense_param_bytes=dense_param_bytes,
                          compute_s=compute_s, optimizer_state_per_row=optimizer_state_per_row)  # fmt: skip

    @classmethod
    def from_batches(cls, batches: Iterable[Any], *, items: int, dim: int, negative_sampling: NegativeSampling = "uniform",
                     action_types: int = 0) -> PretrainWorkload:  # fmt: skip
        """Learn ``T``, ``K`` and the Zipf exponent from one rank's training batches (``SequenceBatch``es or their KJTs).

        The pool is taken as shared by the batch (``SequencePretrainDataModule``'s negatives).
        """
        examples = tokens = negatives = draws = distinct = count = 0
        for batch in batches:
            sparse = getattr(batch, "sparse", batch)
            history = sparse[HISTORY]
            examples += int(history.lengths().numel())
            tokens += int(history.values().numel())
            negatives += int(sparse[NEGATIVES].values().numel()) if NEGATIVES in sparse.keys() else 0
            draws += int(history.values().numel())
            distinct += int(history.values().unique().numel())
            count += 1
        if not count or not tokens:
            raise ValueError("PretrainWorkload.from_batches needs at least one batch with history ids.")
        exponent = zipf_exponent_for_distinct(items, round(draws / count), max(1, round(distinct / count)))
        return cls(items=items, dim=dim, batch_per_rank=max(1, round(examples / count)), tokens_per_example=tokens / examples,
                   num_negatives=round(negatives / count), negative_sampling=negative_sampling, zipf_exponent=exponent,
                   action_types=action_types)  # fmt: skip


def ranking_eval_traffic(
    *, batch_per_rank: int, dim: int, seen_per_example: float, group_size: int, column_sliced_rows: int = 0, value_bytes: int = 4
) -> list[Collective]:
    """One full-ranking evaluation batch's collectives per rank (``parallel/ranking``: ``exchange.py``), over the sharding group.

    A size header (4 int64) and, padded to the group's largest batch, the seen lengths and targets (2 int64
    per query), the queries (``dim`` values) and the seen ids (int64) are all-gathered; the target rows
    (``dim`` values per query of the group) and the counts (1 int64 per query of the group) are all-reduced.
    ``column_sliced_rows``: rows of a column-sliced table, whose columns one all-to-all per chunk brings together
    (each rank sends its columns of every row: ``rows x dim / group_size`` values).
    """
    b, g = batch_per_rank, group_size
    gathered = 4 * 8 + b * 2 * 8 + b * dim * value_bytes + b * seen_per_example * 8
    reduced = g * b * dim * value_bytes + g * b * 8
    out = [
        Collective(purpose="ranking", op="all_gather", group="shard", calls=4, payload_bytes=gathered),
        Collective(purpose="ranking", op="all_reduce", group="shard", calls=2, payload_bytes=reduced),
    ]
    if column_sliced_rows:
        out.append(Collective(purpose="ranking", op="all_to_all", group="shard", calls=1,
                              payload_bytes=column_sliced_rows * dim * value_bytes / g))  # fmt: skip
    return out

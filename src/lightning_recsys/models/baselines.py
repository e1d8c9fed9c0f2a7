"""Baselines without learning that a ranker should beat: item popularity and user + item bias.

Both are fit on a training split's ``(key, label)`` pairs and score another split; single-device
numpy code. A rate is smoothed towards the training split's positive rate ``p`` with
``strength`` pseudo-examples: ``(positives + strength * p) / (examples + strength)``, so a key seen
once is not scored 0 or 1, and a key never seen in training scores ``p``.

- ``PopularityBaseline``: a key's (an item's, or any categorical value's) smoothed positive rate.
- ``UserItemBiasBaseline``: the user's and the item's smoothed rates added as log-odds, relative to
  the base rate: ``sigmoid(logit(r_user) + logit(r_item) - logit(p))``. (The ``- logit(p)`` makes
  it a probability where neither key says anything; AUC does not depend on it.)
- ``RecentPositiveRateBaseline``: history-aware: the smoothed positive rate of the user's newest
  ``window`` earlier actions, ``(positives + strength * p) / (actions + strength)``, optionally
  added as log-odds to the item's smoothed rate like ``UserItemBiasBaseline``. It reads the same
  histories a sequence ranker does, so a sequence ranker's gain over it is the gain of learning.

``auc`` and ``normalized_entropy`` score predicted probabilities the way the rankers' ``val/auc``
and ``val/ne`` do (``NE = logloss / H(mean label)``); both are NaN where the rankers' are (one
class; for ``auc`` also a NaN prediction, a label other than 0 or 1, or no example), ``auc`` with
the rankers' warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from lightning_recsys.models.metrics import AUC

_EPS = 1e-7  # probabilities are clipped to [eps, 1 - eps] before a log


def _logit(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(p, _EPS, 1 - _EPS)
    return np.log(p) - np.log1p(-p)


@dataclass
class SmoothedRate:
    """Per-key smoothed positive rates, fit by ``SmoothedRate.fit``; ``rates[k]`` for keys ``0 .. n-1``."""

    rates: np.ndarray
    counts: np.ndarray
    base_rate: float

    @classmethod
    def fit(cls, keys: np.ndarray, labels: np.ndarray, num_keys: int, strength: float, base_rate: float | None = None) -> SmoothedRate:
        keys, labels = np.asarray(keys, dtype=np.int64), np.asarray(labels, dtype=np.float64)
        if keys.shape != labels.shape or keys.ndim != 1:
            raise ValueError(f"keys {keys.shape} and labels {labels.shape} must be 1-D and of one length.")
        if len(keys) == 0:
            raise ValueError("no training examples to fit a rate on.")
        if keys.min() < 0 or keys.max() >= num_keys:
            raise ValueError(f"keys must be in [0, num_keys={num_keys}); found {keys.min()}..{keys.max()}.")
        if not strength >= 0:
            raise ValueError(f"strength={strength} must be >= 0.")
        p = float(labels.mean()) if base_rate is None else base_rate
        counts = np.bincount(keys, minlength=num_keys).astype(np.float64)
        positives = np.bincount(keys, weights=labels, minlength=num_keys)
        with np.errstate(invalid="ignore", divide="ignore"):
            rates = (positives + strength * p) / (counts + strength)
        rates[counts + strength == 0] = p  # unseen with no smoothing
        return cls(rates=rates, counts=counts, base_rate=p)

    def __call__(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.int64)
        out = np.full(keys.shape, self.base_rate)
        known = (keys >= 0) & (keys < len(self.rates))
        out[known] = self.rates[keys[known]]
        return out


class PopularityBaseline:
    """A key's smoothed positive rate in the training split (items, for MovieLens)."""

    def __init__(self, strength: float = 10.0) -> None:
        self.strength = strength
        self.item: SmoothedRate | None = None

    def fit(self, items: np.ndarray, labels: np.ndarray, num_items: int) -> PopularityBaseline:
        self.item = SmoothedRate.fit(items, labels, num_items, self.strength)
        return self

    def predict(self, items: np.ndarray) -> np.ndarray:
        if self.item is None:
            raise RuntimeError("PopularityBaseline.predict before fit.")
        return self.item(items)


class UserItemBiasBaseline:
    """The user's and the item's smoothed positive rates, added as log-odds around the base rate."""

    def __init__(self, strength: float = 10.0) -> None:
        self.strength = strength
        self.user: SmoothedRate | None = None
        self.item: SmoothedRate | None = None

    def fit(self, users: np.ndarray, items: np.ndarray, labels: np.ndarray, num_users: int, num_items: int) -> UserItemBiasBaseline:
        self.user = SmoothedRate.fit(users, labels, num_users, self.strength)
        self.item = SmoothedRate.fit(items, labels, num_items, self.strength)
        return self

    def predict(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        if self.user is None or self.item is None:
            raise RuntimeError("UserItemBiasBaseline.predict before fit.")
        logits = _logit(self.user(users)) + _logit(self.item(items)) - _logit(self.user.base_rate)
        return 1.0 / (1.0 + np.exp(-logits))


class RecentPositiveRateBaseline:
    """The smoothed positive rate of each example's newest ``window`` history actions (``None``: all of them).

    Histories are jagged: ``lengths[b]`` flags per example, oldest first, concatenated in
    ``positive`` (1 where that earlier action was a positive one). ``fit`` takes the training
    labels (for the base rate ``p``) and, with ``with_item=True``, the training items (the item's
    smoothed rate is then added as log-odds, as in ``UserItemBiasBaseline``).
    """

    def __init__(self, window: int | None = 10, strength: float = 10.0, with_item: bool = False) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window={window!r} must be an integer >= 1, or None for the whole history.")
        if not strength >= 0:
            raise ValueError(f"strength={strength} must be >= 0.")
        self.window, self.strength, self.with_item = window, strength, with_item
        self.base_rate: float | None = None
        self.item: SmoothedRate | None = None

    def fit(self, labels: np.ndarray, items: np.ndarray | None = None, num_items: int | None = None) -> RecentPositiveRateBaseline:
        labels = np.asarray(labels, dtype=np.float64)
        if labels.size == 0:
            raise ValueError("no training examples to fit a rate on.")
        self.base_rate = float(labels.mean())
        if self.with_item:
            if items is None or num_items is None:
                raise ValueError("with_item=True needs the training items and num_items.")
            self.item = SmoothedRate.fit(items, labels, num_items, self.strength)
        return self

    def predict(self, positive: np.ndarray, lengths: np.ndarray, items: np.ndarray | None = None) -> np.ndarray:
        if self.base_rate is None:
            raise RuntimeError("RecentPositiveRateBaseline.predict before fit.")
        positive, lengths = np.asarray(positive, dtype=np.float64), np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.min(initial=0) < 0 or lengths.sum() != positive.size:
            raise ValueError(f"lengths (sum {lengths.sum()}) must be >= 0 and add up to the {positive.size} history flags.")
        ends = np.cumsum(lengths)
        starts = ends - lengths if self.window is None else np.maximum(ends - lengths, ends - self.window)
        totals = np.concatenate([[0.0], np.cumsum(positive)])
        counts = (ends - starts).astype(np.float64)
        p = self.base_rate
        with np.errstate(invalid="ignore", divide="ignore"):
            rates = (totals[ends] - totals[starts] + self.strength * p) / (counts + self.strength)
        rates[counts + self.strength == 0] = p  # an empty history with no smoothing
        if not self.with_item:
            return rates
        if self.item is None or items is None:
            raise ValueError("with_item=True: pass the items being scored (and fit with the training items).")
        logits = _logit(rates) + _logit(self.item(items)) - _logit(p)
        return 1.0 / (1.0 + np.exp(-logits))


def log_loss(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Mean binary log loss of probabilities (clipped to ``[eps, 1 - eps]``), as the rankers' ``logloss``."""
    p = np.clip(np.asarray(probabilities, dtype=np.float64), _EPS, 1 - _EPS)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def auc(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC, computed by the rankers' ``val/auc`` metric (``lightning_recsys.models.AUC``; it depends
    only on the order, so probabilities give what their logits would). NaN with a warning where AUC
    is undefined: one class, a NaN prediction, a label other than 0 or 1, no example. Local to this
    process: it does not sync across ranks, whatever process group exists."""
    metric = AUC(sync_on_compute=False)  # a torchmetrics Metric syncs over the default group when one exists
    metric.update(torch.as_tensor(np.asarray(probabilities, dtype=np.float64)), torch.as_tensor(np.asarray(labels, dtype=np.float64)))
    return float(metric.compute())


def normalized_entropy(probabilities: np.ndarray, labels: np.ndarray) -> float:
    """Mean log loss over the entropy of the labels' own positive rate; 1.0 is the constant base-rate guess."""
    logloss = log_loss(probabilities, labels)
    ctr = float(np.mean(labels))
    if not 0 < ctr < 1:
        return math.nan
    return float(logloss / -(ctr * math.log(ctr) + (1 - ctr) * math.log1p(-ctr)))
